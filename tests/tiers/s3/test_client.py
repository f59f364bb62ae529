"""The s3 tier's client on its own: uploads, retries, deadlines and the errors it tells apart.

Every request goes to a real S3-speaking server on loopback (moto, rclone), through
the chaos proxy where the server must misbehave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from botocore.exceptions import ClientError
from s3_servers import ACCESS_KEY, SECRET_KEY, ChaosProxy, free_port, put_object, raw_client

from kvtier import ConfigError
from kvtier.format import MISSING
from kvtier.tiers.s3 import S3Client, S3Settings, S3TierError
from kvtier.tiers.s3.client import Failed, Upload, each

pytestmark = pytest.mark.anyio

HEADER = 4096
ROW = 64 * 1024
MIB = 1 << 20


class Retries:
    """Counts the retries a client reports."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def make_client(
    endpoint: str,
    bucket: str,
    *,
    row: int = ROW,
    deadline_s: float = 20.0,
    retries: Retries | None = None,
    settings: S3Settings | None = None,
    **params: object,
) -> S3Client:
    if settings is None:
        given = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, **params}
        settings = S3Settings.from_params(
            {"bucket": bucket, "endpoint_url": endpoint, **given}, "secondary_tiers[0]"
        )
    return S3Client(
        settings,
        object_bytes=HEADER + row,
        job_deadline_s=deadline_s,
        label="tier 1:s3",
        on_retry=retries or Retries(),
    )


@pytest.fixture
async def client(moto, bucket) -> AsyncIterator[S3Client]:
    async with make_client(moto.endpoint, bucket) as opened:
        await opened.open()
        yield opened


@contextlib.asynccontextmanager
async def behind_proxy(
    moto, bucket: str, **options: Any
) -> AsyncIterator[tuple[ChaosProxy, S3Client]]:
    """An open client whose requests pass the chaos proxy on their way to moto."""
    async with (
        ChaosProxy(moto.port) as proxy,
        make_client(proxy.endpoint, bucket, **options) as client,
    ):
        await client.open()
        yield proxy, client


def chunk(row: int = ROW, seed: int = 1) -> tuple[memoryview, memoryview]:
    data = bytes((seed * i) % 251 for i in range(HEADER + row))
    return memoryview(bytearray(data[:HEADER])), memoryview(bytearray(data[HEADER:]))


def empty(row: int = ROW) -> tuple[memoryview, memoryview]:
    return memoryview(bytearray(HEADER)), memoryview(bytearray(row))


async def test_each_runs_every_item_and_keeps_each_failure_to_itself():
    async def work(item: int) -> int:
        if item == 2:
            raise ValueError("two")
        return item * 10

    outcomes = await each([1, 2, 3], work)
    assert outcomes[0] == 10 and outcomes[2] == 30
    assert isinstance(outcomes[1], Failed) and str(outcomes[1].error) == "two"


# --------------------------------------------------------------- requests


async def test_an_object_goes_up_and_comes_back_byte_exact(client):
    header, row = chunk()
    assert await client.put("a.kvt", header, row, client.deadline(), only_if_absent=True) is (
        Upload.DONE
    )
    assert await client.head("a.kvt", client.deadline()) == HEADER + ROW
    got_header, got_row = empty()
    assert await client.get_into("a.kvt", got_header, got_row, client.deadline()) is None
    assert bytes(got_header) == bytes(header) and bytes(got_row) == bytes(row)


async def test_a_missing_object_is_none_to_head_and_missing_to_get(client):
    assert await client.head("absent.kvt", client.deadline()) is None
    assert await client.get_into("absent.kvt", *empty(), client.deadline()) == MISSING


@pytest.mark.parametrize(("extra", "problem"), [(-10, "truncated object"), (10, "oversize object")])
async def test_an_object_of_the_wrong_length_is_reported_not_read_past(
    moto, bucket, client, extra, problem
):
    await put_object(moto.endpoint, bucket, "odd.kvt", b"x" * (HEADER + ROW + extra))
    header, row = empty()
    assert await client.get_into("odd.kvt", header, row, client.deadline()) == problem
    assert await client.head("odd.kvt", client.deadline()) == HEADER + ROW + extra


async def test_an_upload_only_if_absent_leaves_the_object_there(moto, bucket, client):
    first, second = chunk(seed=1), chunk(seed=2)
    deadline = client.deadline()
    assert await client.put("k.kvt", *first, deadline, only_if_absent=True) is Upload.DONE
    assert await client.put("k.kvt", *second, deadline, only_if_absent=True) is Upload.PRESENT
    got = empty()
    await client.get_into("k.kvt", *got, deadline)
    assert bytes(got[1]) == bytes(first[1])
    # Without the condition the upload replaces it (a corrupt object is replaced so).
    assert await client.put("k.kvt", *second, deadline, only_if_absent=False) is Upload.DONE
    await client.get_into("k.kvt", *got, deadline)
    assert bytes(got[1]) == bytes(second[1])


async def test_a_big_object_goes_up_in_parts_of_the_same_memory(moto, bucket):
    row = 6 * MIB  # with the header, two parts of at most 5 MiB
    async with make_client(
        moto.endpoint, bucket, row=row, multipart_threshold=1, multipart_part_bytes=5 * MIB
    ) as client:
        await client.open()
        header, data = chunk(row)
        assert await client.put(
            "big.kvt", header, data, client.deadline(), only_if_absent=True
        ) is (Upload.DONE)
        got_header, got_row = empty(row)
        assert await client.get_into("big.kvt", got_header, got_row, client.deadline()) is None
        assert bytes(got_row) == bytes(data)
    async with raw_client(moto.endpoint) as raw:
        head = await raw.head_object(Bucket=bucket, Key="big.kvt")
    assert head["ETag"].strip('"').endswith("-2")


async def test_a_failed_multipart_upload_is_aborted(moto, bucket):
    row = 3 * MIB
    params = {
        "bucket": bucket,
        "endpoint_url": moto.endpoint,
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY,
        "multipart_threshold": 1,
    }
    # Parts under S3's 5 MiB floor (which from_params refuses): the server accepts
    # each part, then refuses to complete the upload.
    settings = dataclasses.replace(S3Settings.from_params(params, "s3"), multipart_part_bytes=MIB)
    async with make_client(moto.endpoint, bucket, row=row, settings=settings) as client:
        await client.open()
        with pytest.raises(ClientError, match="EntityTooSmall"):
            await client.put("parts.kvt", *chunk(row), client.deadline(), only_if_absent=False)
        assert await client.head("parts.kvt", client.deadline()) is None
    async with raw_client(moto.endpoint) as raw:
        uploads = await raw.list_multipart_uploads(Bucket=bucket)
    assert not uploads.get("Uploads")


# ------------------------------------------------------------- retries


async def test_throttling_is_retried_until_the_server_accepts(moto, bucket):
    retries = Retries()
    async with behind_proxy(moto, bucket, retries=retries) as (proxy, client):
        proxy.refuse = 3
        await proxy.drop_connections()
        deadline = client.deadline()
        assert await client.put("t.kvt", *chunk(), deadline, only_if_absent=False) is (Upload.DONE)
        assert proxy.refused == 3
        assert retries.count == 3
        assert await client.head("t.kvt", deadline) == HEADER + ROW


async def test_persistent_throttling_ends_after_the_retry_attempts(moto, bucket):
    retries = Retries()
    async with behind_proxy(moto, bucket, retries=retries, retry_attempts=2) as (proxy, client):
        proxy.refuse = 1_000_000
        await proxy.drop_connections()
        with pytest.raises(ClientError, match=r"\(503\)"):  # a HEAD has no body to name it
            await client.head("t.kvt", client.deadline())
        assert retries.count == 2
        assert proxy.refused == 3  # the first attempt and two retries
        proxy.refuse = 0


async def test_a_refused_connection_is_retried_then_fails_the_open():
    retries = Retries()
    endpoint = f"http://127.0.0.1:{free_port()}"
    async with make_client(endpoint, "kvtier", retries=retries, retry_attempts=2) as client:
        with pytest.raises(S3TierError, match=r"^tier 1:s3: cannot reach bucket 'kvtier'"):
            await client.open()
    assert retries.count == 2


async def test_a_refusal_that_will_not_change_is_not_retried(rclone):
    retries = Retries()
    async with make_client(
        rclone.endpoint, "kvtier", retries=retries, secret_access_key="not-the-secret"
    ) as client:
        with pytest.raises(
            ConfigError, match=r"^secondary_tiers\[0\]\.bucket: access to bucket 'kvtier' .*403"
        ):
            await client.open()
    assert retries.count == 0


async def test_the_job_deadline_ends_a_request_to_a_silent_server(moto, bucket):
    async with behind_proxy(moto, bucket, deadline_s=1.0) as (proxy, client):
        proxy.stall = True
        await proxy.drop_connections()
        started = time.monotonic()
        with pytest.raises(S3TierError, match="ran past the job deadline of 1 s"):
            await client.head("t.kvt", client.deadline())
        assert time.monotonic() - started < 10  # the read timeout alone is 10 s
        proxy.stall = False
        await proxy.drop_connections()


async def test_a_server_without_conditional_writes_gets_plain_uploads(moto, bucket, caplog):
    caplog.set_level(logging.INFO, logger="kvtier")
    async with behind_proxy(moto, bucket) as (proxy, client):
        proxy.no_conditional_writes = True
        await proxy.drop_connections()
        deadline = client.deadline()
        for name in ("a.kvt", "b.kvt"):
            assert await client.put(name, *chunk(), deadline, only_if_absent=True) is (Upload.DONE)
        assert client.conditional_writes is False
        notes = [r for r in caplog.records if "conditional writes" in r.getMessage()]
        assert len(notes) == 1


# -------------------------------------------------------------- lifecycle


async def test_a_missing_bucket_fails_the_open_naming_the_setting(moto):
    async with make_client(moto.endpoint, "no-such-bucket-kvtier") as client:
        with pytest.raises(
            ConfigError, match=r"^secondary_tiers\[0\]\.bucket: bucket '.*' does not exist"
        ):
            await client.open()


async def test_closing_twice_is_harmless_and_a_closed_client_sends_nothing(moto, bucket):
    client = make_client(moto.endpoint, bucket)
    await client.open()
    await client.aclose()
    await client.aclose()
    with pytest.raises(RuntimeError, match="not open"):
        await client.head("a.kvt", client.deadline())


async def test_a_listing_goes_through_every_page(client, moto, bucket):
    names = [f"listed/{i:02d}.kvt" for i in range(7)]
    for name in names:
        await put_object(moto.endpoint, bucket, name, b"x")
    await put_object(moto.endpoint, bucket, "elsewhere/00.kvt", b"x")
    deadline = client.deadline()
    assert sorted(await client.list_names("listed/", deadline, page_size=2)) == names
    assert sorted(await client.list_names("listed/", deadline)) == names
    assert await client.list_names("nothing/", deadline) == []
