"""The s3 tier against S3-speaking servers on loopback: s3, rclone, SeaweedFS, and a
chaos proxy.

A test that takes ``s3`` runs against moto; those marked :data:`ON_EVERY_SERVER`
against SeaweedFS too (``bucket`` is then a fresh bucket of that server).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import anyio.to_thread
import pytest
import torch
import trustme
from helpers import damaged, keys, store_all, tiering_config
from s3_servers import (
    ACCESS_KEY,
    SECRET_KEY,
    ChaosProxy,
    S3Server,
    TlsProxy,
    free_port,
    fresh_bucket,
    put_object,
    raw_client,
    read_object,
)

from kvtier import ConfigError, KVTier, OffloadingSpecFactory
from kvtier.metrics import Names
from kvtier.records import Medium
from kvtier.tiers.s3 import S3Tier, S3TierError

pytestmark = pytest.mark.anyio

BLOCK = 16 * 1024  # bytes per GPU block; one block per chunk
GPU_BLOCKS = 64
LABEL = {"tier": "1:s3"}
SESSION_TOKEN = "FwoGZXIvYXdzEXAMPLEsessiontoken0000000000000000000001"

#: Runs a test against moto and against SeaweedFS (a real server binary, slower).
ON_EVERY_SERVER = pytest.mark.parametrize(
    "s3", ["moto", pytest.param("seaweed", marks=pytest.mark.slow)], indirect=True
)


@pytest.fixture
def bucket(s3: S3Server) -> Iterator[str]:
    """A fresh, empty bucket on the test's server (see the ``s3`` fixture)."""
    with fresh_bucket(s3.endpoint) as name:
        yield name


def kv_tensor(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (GPU_BLOCKS, BLOCK), dtype=torch.uint8, generator=gen)


def s3_config(engine_id, endpoint, bucket, *, chunks=4, model="test-model", block=BLOCK, **tier):
    events = tier.pop("enable_kv_events", False)
    params = {
        "type": "s3",
        "bucket": bucket,
        "endpoint_url": endpoint,
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY,
        **tier,
    }
    return tiering_config(
        engine_id,
        [params],
        chunks=chunks,
        kv_bytes_per_block=block,
        model_name=model,
        enable_kv_events=events,
    )


def s3_tier(kv: KVTier) -> S3Tier:
    tier = kv.manager.tiers[0]
    assert isinstance(tier, S3Tier)
    return tier


def metric(kv: KVTier, name: str) -> float:
    kv.manager.on_schedule_end()  # flushes the step's counts
    return kv.manager.metrics.sample(f"{name}_total", LABEL) or 0.0


# ------------------- objects and lookups (the shared contract: test_contract_s3.py)


@ON_EVERY_SERVER
async def test_objects_follow_the_documented_layout(engine_id, s3, bucket):
    config = s3_config(
        engine_id,
        s3.endpoint,
        bucket,
        model="org/Model-7B",
        prefix="/team/kv/",
        enable_kv_events=True,
    )
    async with KVTier(config, [kv_tensor()]) as kv:
        [key] = keys("layout", 1)
        await store_all(kv, [key])
        tier = s3_tier(kv)
        digest = hashlib.sha256(tier.ctx.namespace.encode()).hexdigest()[:32]
        name = f"team/kv/org_Model-7B_{digest}/{key.hex()}.kvt"
        assert tier.object_key(key) == name
        async with raw_client(s3.endpoint) as client:
            listing = await client.list_objects_v2(Bucket=bucket)
        assert [item["Key"] for item in listing["Contents"]] == [name]
        data = await read_object(s3.endpoint, bucket, name)
        assert data is not None
        assert len(data) == 4096 + kv.manager.region.chunk_bytes
        assert data[:8] == b"KVTCHUNK"
        stored = [e for e in kv.manager.take_events() if e.tier == "1:s3"]
        assert [(e.keys, e.medium, e.removed) for e in stored] == [((key,), Medium.STORAGE, False)]


@ON_EVERY_SERVER
async def test_a_store_skips_keys_it_knows_are_stored_without_a_request(engine_id, s3, bucket):
    [key] = keys("present", 1)
    async with KVTier(s3_config(engine_id, s3.endpoint, bucket), [kv_tensor()]) as kv:
        await store_all(kv, [key])
        assert metric(kv, "kvtier_s3_stores_skipped") == 0
        await kv.reset()
        await store_all(kv, [key])  # the lookup cache knows the object: nothing sent
        assert metric(kv, "kvtier_s3_stores_skipped") == 1
        assert metric(kv, "kvtier_s3_head_requests") == 0


@ON_EVERY_SERVER
@pytest.mark.parametrize("head_before_store", [False, True])
async def test_a_store_leaves_another_engine_s_object_alone(
    engine_id, s3, bucket, head_before_store
):
    [key] = keys("present", 1)
    async with KVTier(s3_config(engine_id, s3.endpoint, bucket), [kv_tensor()]) as kv:
        await store_all(kv, [key])
        name = s3_tier(kv).object_key(key)
    async with raw_client(s3.endpoint) as client:
        before = (await client.head_object(Bucket=bucket, Key=name))["ETag"]
    # Another engine, other bytes for the same key: a HEAD first, or a conditional
    # upload the server refuses, leaves the first object in place.
    other = s3_config(f"{engine_id}b", s3.endpoint, bucket, head_before_store=head_before_store)
    async with KVTier(other, [kv_tensor(5)]) as kv:
        await store_all(kv, [key])
        assert metric(kv, "kvtier_s3_stores_skipped") == 1
        assert metric(kv, "kvtier_s3_head_requests") == (1 if head_before_store else 0)
        assert metric(kv, Names.CASCADE_JOB_FAILURES) == 0
        assert s3_tier(kv).contains(key) is True
    async with raw_client(s3.endpoint) as client:
        assert (await client.head_object(Bucket=bucket, Key=name))["ETag"] == before


async def test_lookups_are_batched_heads_answered_from_a_ttl_cache(engine_id, s3, bucket):
    ks = keys("cached", 6)
    async with KVTier(s3_config(engine_id, s3.endpoint, bucket, chunks=8), [kv_tensor()]) as kv:
        await store_all(kv, ks[:4])
    config = s3_config(f"{engine_id}r", s3.endpoint, bucket, chunks=8, lookup_cache_ttl_s=600)
    async with KVTier(config, [kv_tensor()]) as kv:
        tier = s3_tier(kv)
        assert [tier.contains(k) for k in ks] == [None] * 6
        assert await kv.lookup(ks, "r1", timeout=30) == 4  # one batch of HEADs
        assert metric(kv, "kvtier_s3_head_requests") == 6
        assert [tier.contains(k) for k in ks] == [True] * 4 + [False] * 2
        kv.finish("r1")
        await kv.reset()
        assert await kv.lookup(ks, "r2", timeout=30) == 4  # from the cache
        assert metric(kv, "kvtier_s3_head_requests") == 6
    config = s3_config(f"{engine_id}t", s3.endpoint, bucket, lookup_cache_ttl_s=0.2)
    async with KVTier(config, [kv_tensor()]) as kv:
        tier = s3_tier(kv)
        assert list(await tier.lookup(ks[3:5])) == [True, False]
        await asyncio.sleep(0.3)
        assert tier.contains(ks[3]) is None  # expired: ask the server again
        assert list(await tier.lookup(ks[3:5])) == [True, False]
        assert metric(kv, "kvtier_s3_head_requests") == 4


@pytest.mark.parametrize(
    ("damage", "cached"),
    [
        ("flip_payload", True),
        ("flip_header", True),
        ("truncate", True),
        ("truncate", False),
        ("append", True),
        ("append", False),
        ("another_key", True),
        ("another_namespace", False),
    ],
)
async def test_damaged_objects_are_misses_deleted_and_counted_never_served(
    engine_id, s3, bucket, damage, cached
):
    kv_cache = kv_tensor()
    ttl = 600 if cached else 0
    config = s3_config(
        engine_id, s3.endpoint, bucket, lookup_cache_ttl_s=ttl, enable_kv_events=True
    )
    if damage == "another_namespace":
        # The same key stored by an engine of another model, copied under our name.
        [key] = keys("foreign", 1)
        other = s3_config(f"{engine_id}o", s3.endpoint, bucket, model="other-model")
        async with KVTier(other, [kv_tensor(1)]) as kv:
            await store_all(kv, [key])
            data = await read_object(s3.endpoint, bucket, s3_tier(kv).object_key(key))
    async with KVTier(config, [kv_cache]) as kv:
        tier = s3_tier(kv)
        if damage == "another_namespace":
            name = tier.object_key(key)
        else:
            key, decoy = keys(f"damage-{damage}", 2)
            await store_all(kv, [key, decoy])
            name = tier.object_key(key)
            data = await read_object(s3.endpoint, bucket, name)
            assert data is not None
            if damage == "another_key":
                data = await read_object(s3.endpoint, bucket, tier.object_key(decoy))
            else:
                data = damaged(data, damage)
        assert data is not None
        await put_object(s3.endpoint, bucket, name, bytes(data))
        await kv.reset()
        kv.manager.take_events()
        before = kv_cache[50].clone()
        assert await kv.lookup([key], "reader", timeout=30) == 0
        assert await kv.load([key], [50], "reader") == 0
        assert torch.equal(kv_cache[50], before)
        assert await read_object(s3.endpoint, bucket, name) is None
        assert metric(kv, Names.INTEGRITY_FAILURES) == 1
        removed = [e for e in kv.manager.take_events() if e.tier == "1:s3" and e.removed]
        assert [e.keys for e in removed] == [(key,)]
        # Stored again, it is whole and served.
        await store_all(kv, [key], first_block=10)
        await kv.reset()
        assert await kv.lookup([key], "again", timeout=30) == 1


@ON_EVERY_SERVER
async def test_multipart_objects_round_trip(engine_id, s3, bucket):
    block = 6 * 1024 * 1024  # > one 5 MiB part
    cache = torch.randint(0, 255, (4, block), dtype=torch.uint8)
    config = s3_config(
        engine_id,
        s3.endpoint,
        bucket,
        chunks=2,
        block=block,
        multipart_threshold=1,
        multipart_part_bytes=5 * 1024 * 1024,
    )
    async with KVTier(config, [cache]) as kv:
        ks = keys("multipart", 2)
        await store_all(kv, ks)
        tier = s3_tier(kv)
        async with raw_client(s3.endpoint) as client:
            head = await client.head_object(Bucket=bucket, Key=tier.object_key(ks[0]))
            uploads = await client.list_multipart_uploads(Bucket=bucket)
        assert head["ContentLength"] == 4096 + block
        assert head["ETag"].strip('"').endswith("-2")  # two parts
        assert not uploads.get("Uploads")
        await kv.reset()
        assert await kv.lookup(ks, "reader", timeout=60) == 2
        assert await kv.load(ks, [2, 3], "reader") == 2
        assert torch.equal(cache[2:4], cache[0:2])


@ON_EVERY_SERVER
async def test_a_refused_multipart_upload_is_aborted_not_left_open(engine_id, s3, bucket):
    # SeaweedFS keeps a multipart upload open when it refuses to complete it
    # (If-None-Match on an object already there): the tier aborts it.
    block = 6 * 1024 * 1024
    params = {"multipart_threshold": 1, "multipart_part_bytes": 5 * 1024 * 1024}
    [key] = keys("refused-multipart", 1)
    first = s3_config(engine_id, s3.endpoint, bucket, chunks=1, block=block, **params)
    cache = torch.randint(0, 255, (2, block), dtype=torch.uint8)
    async with KVTier(first, [cache]) as kv:
        await store_all(kv, [key])
    other = s3_config(f"{engine_id}b", s3.endpoint, bucket, chunks=1, block=block, **params)
    theirs = torch.randint(0, 255, (2, block), dtype=torch.uint8)
    async with KVTier(other, [theirs]) as kv:
        await store_all(kv, [key])
        assert metric(kv, "kvtier_s3_stores_skipped") == 1
        assert metric(kv, Names.CASCADE_JOB_FAILURES) == 0
        await kv.reset()
        assert await kv.lookup([key], "reader", timeout=60) == 1
        assert await kv.load([key], [1], "reader") == 1
        assert torch.equal(theirs[1], cache[0])  # the first engine's object was kept
    async with raw_client(s3.endpoint) as client:
        uploads = await client.list_multipart_uploads(Bucket=bucket)
    assert not uploads.get("Uploads")


@ON_EVERY_SERVER
async def test_an_empty_object_under_a_chunk_s_name_is_a_counted_miss_and_replaced(
    engine_id, s3, bucket
):
    # What SeaweedFS leaves where a PUT's connection closed before its body began.
    [key] = keys("empty", 1)
    config = s3_config(engine_id, s3.endpoint, bucket, lookup_cache_ttl_s=0)
    async with KVTier(config, [kv_tensor()]) as kv:
        name = s3_tier(kv).object_key(key)
        await put_object(s3.endpoint, bucket, name, b"")
        assert await kv.lookup([key], "first", timeout=30) == 0
        assert await read_object(s3.endpoint, bucket, name) is None
        assert metric(kv, Names.INTEGRITY_FAILURES) == 1
        kv.finish("first")
        await store_all(kv, [key])
        assert metric(kv, "kvtier_s3_stores_skipped") == 0
        await kv.reset()
        assert await kv.lookup([key], "again", timeout=30) == 1


# -------------------------------------------------- configuration and start


@pytest.mark.parametrize(
    ("params", "path", "says"),
    [
        # Read by S3Settings (tests/tiers/test_settings.py has every parameter).
        ({"bukcet": "x"}, "bukcet", "did you mean 'bucket'"),
        # Checked against the tier's context when the tier is built.
        ({"job_timeout_s": 10, "job_deadline_s": 10}, "job_deadline_s", r"below .* \(10 s\)"),
    ],
)
def test_bad_settings_fail_the_build_naming_their_key(engine_id, params, path, says):
    config = s3_config(engine_id, "http://127.0.0.1:9", "kvtier", **params)
    with pytest.raises(ConfigError, match=rf"^secondary_tiers\[0\]\.{path}: .*{says}"):
        OffloadingSpecFactory.create_spec(config).get_manager()


@ON_EVERY_SERVER
async def test_a_missing_bucket_fails_start_clearly_and_releases_the_region(engine_id, s3):
    config = s3_config(engine_id, s3.endpoint, "no-such-bucket-kvtier")
    with pytest.raises(
        ConfigError,
        match=r"secondary_tiers\[0\]\.bucket: bucket 'no-such-bucket-kvtier' does not exist",
    ):
        async with KVTier(config, [kv_tensor()]):
            pass  # pragma: no cover - never reached
    # The engine_id fixture checks that the region's file is gone.


async def test_an_https_endpoint_of_a_private_authority_is_trusted_through_ca_bundle(
    engine_id, s3, bucket, tmp_path
):
    ca = trustme.CA()
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    kv_cache = kv_tensor()
    async with TlsProxy(s3.port, ca) as proxy:
        # The system's authorities do not know this one: the tier cannot start.
        untrusted = s3_config(engine_id, proxy.endpoint, bucket, retry_attempts=0)
        with pytest.raises(S3TierError, match=f"cannot reach bucket '{bucket}'"):
            async with KVTier(untrusted, [kv_cache]):
                pass  # pragma: no cover - never reached
        trusted = s3_config(engine_id, proxy.endpoint, bucket, ca_bundle=str(bundle))
        async with KVTier(trusted, [kv_cache]) as kv:
            ks = keys("private-ca", 2)
            await store_all(kv, ks)
            await kv.reset()
            assert await kv.lookup(ks, "reader", timeout=30) == 2
            assert await kv.load(ks, [40, 41], "reader") == 2
            assert torch.equal(kv_cache[40:42], kv_cache[0:2])


async def test_an_unreachable_endpoint_fails_start_in_bounded_time(engine_id):
    endpoint = f"http://127.0.0.1:{free_port()}"
    config = s3_config(engine_id, endpoint, "kvtier", connect_timeout_s=0.5, retry_attempts=1)
    started = time.monotonic()
    with pytest.raises(S3TierError, match="cannot reach bucket 'kvtier'"):
        async with KVTier(config, [kv_tensor()]):
            pass  # pragma: no cover - never reached
    assert time.monotonic() - started < 10


async def test_secrets_never_appear_in_logs_reprs_or_errors(engine_id, s3, bucket, caplog):
    secret, token = "Zsecret/Key+ThatMustNeverLeak00000000000", SESSION_TOKEN
    caplog.set_level(logging.DEBUG, logger="kvtier")
    caplog.set_level(logging.INFO)
    texts: list[str] = []
    config = s3_config(
        engine_id, s3.endpoint, bucket, secret_access_key=secret, session_token=token
    )
    async with KVTier(config, [kv_tensor()]) as kv:
        ks = keys("secret", 2)
        await store_all(kv, ks)
        await kv.reset()
        assert await kv.lookup(ks, "reader", timeout=30) == 2
        tier = s3_tier(kv)
        texts += [repr(tier), str(tier), repr(vars(tier))]
    bad = [
        s3_config(engine_id, s3.endpoint, "no-such-bucket-kvtier", secret_access_key=secret),
        s3_config(engine_id, s3.endpoint, bucket, secret_access_key=secret, access_key_id=None),
        s3_config(engine_id, s3.endpoint, bucket, secret_access_key=[secret]),
        s3_config(engine_id, s3.endpoint, bucket, session_token=token, surprise=secret),
    ]
    for config in bad:
        with pytest.raises(ConfigError) as info:
            async with KVTier(config, [kv_tensor()]):
                pass  # pragma: no cover - never reached
        texts.append(str(info.value))
        texts.append(repr(info.value))
    texts += [record.getMessage() for record in caplog.records]
    texts += [str(record.args) for record in caplog.records]
    kvtier_logs = [r.getMessage() for r in caplog.records if r.name.startswith("kvtier")]
    assert texts
    for text in texts:
        assert secret not in text
        assert token not in text
    for text in kvtier_logs:
        assert ACCESS_KEY not in text


# ------------------------------------------------------ a real server binary


async def test_round_trip_through_rclone_serve_s3(engine_id, rclone, tmp_path):
    kv_cache = kv_tensor()
    config = s3_config(engine_id, rclone.endpoint, "kvtier", prefix="cache", chunks=8)
    async with KVTier(config, [kv_cache]) as kv:
        ks = keys("rclone", 12)
        await store_all(kv, ks)
        tier = s3_tier(kv)
        on_disk = tmp_path / "s3root" / "kvtier" / tier.object_key(ks[0])
        assert on_disk.stat().st_size == 4096 + kv.manager.region.chunk_bytes
        await kv.reset()
        assert await kv.lookup(ks[:8], "reader", timeout=30) == 8
        assert await kv.load(ks[:8], list(range(40, 48)), "reader") == 8
        assert torch.equal(kv_cache[40:48], kv_cache[0:8])
        # Corrupted on the server's disk: a miss, deleted, counted.
        data = bytearray(on_disk.read_bytes())
        data[5000] ^= 0xFF
        on_disk.write_bytes(bytes(data))
        kv.finish("reader")
        await kv.reset()
        assert await kv.lookup(ks[:1], "again", timeout=30) == 0
        assert not on_disk.exists()
        assert metric(kv, Names.INTEGRITY_FAILURES) == 1


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (as /proc/net writes them) of ``pid``'s listening TCP
    sockets and its UDP sockets."""
    inodes = {
        target[len("socket:[") : -1]
        for fd in Path(f"/proc/{pid}/fd").iterdir()
        if (target := os.readlink(fd)).startswith("socket:[")
    }
    found = set()
    # 0A: a TCP socket that listens; 07: a UDP socket.
    for table, state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == state and fields[9] in inodes:
                found.add(f"{table} {fields[1]}")
    return found


def test_seaweedfs_listens_on_127_0_0_1_only(seaweed):
    assert seaweed.pid is not None
    found = listening_addresses(seaweed.pid)
    # The S3 gateway, and the master, volume server and filer (HTTP and gRPC each),
    # all on 127.0.0.1 (little-endian hex), none on IPv6 or UDP.
    expected = {f"tcp 0100007F:{port:04X}" for port in (seaweed.port, *seaweed.ports.values())}
    assert found == expected


#: Runs a test against each real server binary (each has a bucket ``kvtier``).
ON_EVERY_BINARY = pytest.mark.parametrize(
    "binary", ["rclone", pytest.param("seaweed", marks=pytest.mark.slow)]
)


@ON_EVERY_BINARY
async def test_wrong_credentials_fail_start_naming_the_bucket(engine_id, binary, request):
    server = request.getfixturevalue(binary)
    config = s3_config(engine_id, server.endpoint, "kvtier", secret_access_key="wrong" * 8)
    with pytest.raises(
        ConfigError,
        match=r"^secondary_tiers\[0\]\.bucket: access to bucket 'kvtier' .* denied \(HTTP 403\)",
    ):
        async with KVTier(config, [kv_tensor()]):
            pass  # pragma: no cover - never reached


@ON_EVERY_BINARY
async def test_signed_payloads_are_accepted(engine_id, binary, request):
    server = request.getfixturevalue(binary)
    kv_cache = kv_tensor()
    config = s3_config(engine_id, server.endpoint, "kvtier", sign_payload=True)
    async with KVTier(config, [kv_cache]) as kv:
        ks = keys("signed", 3)
        await store_all(kv, ks)
        assert metric(kv, Names.CASCADE_JOB_FAILURES) == 0
        await kv.reset()
        assert await kv.lookup(ks, "reader", timeout=30) == 3
        assert await kv.load(ks, [30, 31, 32], "reader") == 3
        assert torch.equal(kv_cache[30:33], kv_cache[0:3])


async def test_a_server_outage_fails_jobs_in_bounded_time_and_then_recovers(engine_id, rclone):
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.01)
            ticks += 1

    config = s3_config(
        engine_id,
        rclone.endpoint,
        "kvtier",
        chunks=8,
        connect_timeout_s=0.5,
        read_timeout_s=1,
        retry_attempts=1,
        job_deadline_s=3,
        lookup_cache_ttl_s=600,
    )
    async with KVTier(config, [kv_tensor()]) as kv:
        before, during, after = keys("up", 4), keys("down", 4), keys("back", 4)
        await store_all(kv, before)
        await kv.reset()
        task = asyncio.ensure_future(ticker())
        await anyio.to_thread.run_sync(rclone.stop)
        started = time.monotonic()
        # The tier's cache says the chunks are there; fetching them fails: misses.
        assert await kv.lookup(before, "reader", timeout=30) == 0
        await store_all(kv, during, first_block=10)
        elapsed = time.monotonic() - started
        stop.set()
        await task
        assert elapsed < 15, f"jobs against a dead server took {elapsed:.1f} s"
        assert ticks > elapsed * 10  # the loop kept running its timers throughout
        assert metric(kv, Names.PROMOTION_JOB_FAILURES) >= 1
        assert metric(kv, Names.CASCADE_JOB_FAILURES) == 1
        await anyio.to_thread.run_sync(rclone.start)
        await store_all(kv, after, first_block=20)
        assert metric(kv, Names.CASCADE_JOB_FAILURES) == 1
        kv.finish("reader")
        await kv.reset()
        assert await kv.lookup(after, "later", timeout=30) == 4


@pytest.mark.slow
async def test_a_seaweedfs_killed_and_restarted_costs_counted_misses_then_hits_again(
    engine_id, seaweed_alone
):
    server = seaweed_alone
    kv_cache = kv_tensor()
    config = s3_config(
        engine_id,
        server.endpoint,
        "kvtier",
        chunks=8,
        connect_timeout_s=0.5,
        read_timeout_s=1,
        retry_attempts=1,
        job_deadline_s=3,
        lookup_cache_ttl_s=600,
    )
    async with KVTier(config, [kv_cache]) as kv:
        before, during, after = keys("stored", 4), keys("crashed", 4), keys("restarted", 4)
        await store_all(kv, before)
        await kv.reset()
        await anyio.to_thread.run_sync(server.kill)
        # The tier's cache says the chunks are there; fetching them fails: misses.
        assert await kv.lookup(before, "crashed", timeout=30) == 0
        await store_all(kv, during, first_block=10)
        assert metric(kv, Names.PROMOTION_JOB_FAILURES) >= 1
        assert metric(kv, Names.CASCADE_JOB_FAILURES) == 1
        kv.finish("crashed")
        # Back on the same port over the same disk: what it acknowledged is there.
        await anyio.to_thread.run_sync(server.start)
        await kv.reset()
        assert await kv.lookup(before, "restarted", timeout=30) == 4
        assert await kv.load(before, list(range(40, 44)), "restarted") == 4
        assert torch.equal(kv_cache[40:44], kv_cache[0:4])
        kv.finish("restarted")
        await store_all(kv, after, first_block=20)
        assert metric(kv, Names.CASCADE_JOB_FAILURES) == 1
        await kv.reset()
        assert await kv.lookup(after, "later", timeout=30) == 4
        assert metric(kv, Names.INTEGRITY_FAILURES) == 0


# ------------------------------------------------------------ faults by proxy


async def test_throttling_is_retried_until_the_server_accepts(engine_id, s3, bucket):
    async with ChaosProxy(s3.port) as proxy:
        config = s3_config(engine_id, proxy.endpoint, bucket, retry_attempts=5)
        async with KVTier(config, [kv_tensor()]) as kv:
            proxy.refuse = 3
            await proxy.drop_connections()
            ks = keys("throttled", 2)
            await store_all(kv, ks)
            assert proxy.refused == 3
            assert metric(kv, "kvtier_s3_retries") == 3
            assert metric(kv, Names.CASCADE_JOB_FAILURES) == 0
            await kv.reset()
            assert await kv.lookup(ks, "reader", timeout=30) == 2


async def test_persistent_throttling_fails_the_job_in_bounded_time(engine_id, s3, bucket):
    async with ChaosProxy(s3.port) as proxy:
        config = s3_config(engine_id, proxy.endpoint, bucket, retry_attempts=3, job_deadline_s=5)
        async with KVTier(config, [kv_tensor()]) as kv:
            proxy.refuse = 1_000_000
            await proxy.drop_connections()
            started = time.monotonic()
            await store_all(kv, keys("refused", 2))
            assert time.monotonic() - started < 10
            assert metric(kv, Names.CASCADE_JOB_FAILURES) == 1
            # Each of the two chunks' HEAD was sent four times, then gave up.
            assert metric(kv, "kvtier_s3_retries") == 6
            assert proxy.refused == 8
            proxy.refuse = 0


async def test_a_server_that_stops_answering_fails_jobs_within_the_read_timeout(
    engine_id, s3, bucket
):
    async with ChaosProxy(s3.port) as proxy:
        config = s3_config(
            engine_id,
            proxy.endpoint,
            bucket,
            read_timeout_s=0.5,
            retry_attempts=1,
            lookup_cache_ttl_s=600,
        )
        async with KVTier(config, [kv_tensor()]) as kv:
            ks = keys("stalled", 2)
            await store_all(kv, ks)
            await kv.reset()
            proxy.stall = True
            await proxy.drop_connections()
            started = time.monotonic()
            assert await kv.lookup(ks, "reader", timeout=30) == 0
            assert time.monotonic() - started < 10
            assert metric(kv, Names.PROMOTION_JOB_FAILURES) == 1
            proxy.stall = False
            await proxy.drop_connections()


async def test_a_server_without_conditional_writes_gets_plain_uploads(
    engine_id, s3, bucket, caplog
):
    caplog.set_level(logging.INFO, logger="kvtier")
    async with ChaosProxy(s3.port) as proxy:
        config = s3_config(engine_id, proxy.endpoint, bucket)
        async with KVTier(config, [kv_tensor()]) as kv:
            proxy.no_conditional_writes = True
            await proxy.drop_connections()
            ks = keys("unconditional", 3)
            await store_all(kv, ks)
            assert metric(kv, Names.CASCADE_JOB_FAILURES) == 0
            notes = [
                r.getMessage() for r in caplog.records if "conditional writes" in r.getMessage()
            ]
            assert len(notes) == 1  # said once, then uploads go without the header
            await kv.reset()
            assert await kv.lookup(ks, "reader", timeout=30) == 3
