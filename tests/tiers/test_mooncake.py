"""The mooncake tier: its settings (and a mooncake.json's), what it derives from the
engine, and a real Mooncake master on loopback (tests/mooncake_server.py): damaged
objects, a master killed and started again, a node lending the segment that holds a
chunk killed, and engines in separate processes sharing one pool."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from typing import Any

import anyio
import mooncake_procs
import pytest
import torch
from helpers import damaged, keys, store_all, tiering_config
from mooncake_server import SEGMENT_BYTES, MooncakeMaster, RawStore, mooncake_tier

from kvtier import ConfigError, KVTier
from kvtier.bench.servers import free_port
from kvtier.cli import main
from kvtier.format import HEADER_BYTES
from kvtier.metrics import MetricsRecorder, Names
from kvtier.records import HitSource, Medium
from kvtier.region import PrimaryView
from kvtier.tiers.base import TierContext, TransferJob
from kvtier.tiers.factory import SecondaryTierFactory
from kvtier.tiers.mooncake import (
    CONFIG_PATH_VARIABLE,
    DEFAULT_GLOBAL_SEGMENT_SIZE,
    PROGRESS_TIMEOUT_VARIABLE,
    MooncakeSettings,
    MooncakeTier,
)

pytestmark = pytest.mark.anyio

PATH = "secondary_tiers[0]"
CHUNK = 16 * 1024
# Waits for what a test caused (a master back, a process up): bounded, never timed.
WAIT_S = 60.0


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    """No mooncake.json from the environment; the progress timeout a tier puts there
    is taken out again after each test."""
    monkeypatch.delenv(CONFIG_PATH_VARIABLE, raising=False)
    monkeypatch.delenv(PROGRESS_TIMEOUT_VARIABLE, raising=False)


def context(chunks: int = 4, *, job_timeout_s: float = 30.0) -> TierContext:
    view = PrimaryView(memoryview(bytearray(chunks * CHUNK)), chunks, CHUNK)
    metrics = MetricsRecorder(MooncakeTier.build_metric_definitions(None))
    return TierContext(
        view,
        CHUNK,
        "kvtier/mooncake-test",
        "1:mooncake",
        metrics=metrics,
        job_timeout_s=job_timeout_s,
    )


def tier(ctx: TierContext, **params: object) -> MooncakeTier:
    return MooncakeTier(ctx, MooncakeTier.settings_for(ctx, params))


def job(job_id: int, ks: list[bytes], slots: list[int], *, promotion: bool) -> TransferJob:
    return TransferJob(job_id, tuple(ks), tuple(slots), promotion, f"r{job_id}")


def failures(kv: KVTier, name: str) -> float:
    kv.manager.on_schedule_end()  # flushes the step's counts
    return kv.manager.metrics.sample(f"{name}_total", {"tier": "1:mooncake"}) or 0.0


# ------------------------------------------------------------------ settings


def test_the_tier_is_remote_memory_and_its_hits_come_from_an_external_store():
    assert MooncakeTier.medium is Medium.REMOTE_MEMORY
    assert MooncakeTier.hit_source is HitSource.EXTERNAL
    assert MooncakeTier.locality == "remote"


@pytest.mark.parametrize(
    ("params", "key", "message"),
    [
        ({"master_server_address": "localhost"}, "master_server_address", "expected"),
        ({"master_server_address": "h:70000"}, "master_server_address", "expected"),
        ({"metadata_server": "ftp://h:1"}, "metadata_server", "expected http"),
        ({"metadata_server": "http://h/metadata"}, "metadata_server", "expected http"),
        ({"protocol": "udp"}, "protocol", "expected one of rdma, tcp"),
        ({"device_name": 3}, "device_name", "expected a string"),
        ({"global_segment_size": -1}, "global_segment_size", ">= 0"),
        ({"global_segment_size": 1 << 20}, "global_segment_size", "at least 16777216"),
        ({"global_segment_size": "4GB"}, "global_segment_size", "expected an integer"),
        ({"local_buffer_size": 1.5}, "local_buffer_size", "expected an integer"),
        ({"io_threads": 0}, "io_threads", ">= 1"),
        ({"master_server": "h:1"}, "master_server", "unknown"),
    ],
)
def test_a_bad_parameter_is_named_by_its_path(params, key, message):
    with pytest.raises(ConfigError, match=rf"^secondary_tiers\[0\]\.{key}: .*{message}"):
        MooncakeSettings.from_params(params, PATH)


def test_the_registry_builds_mooncake_with_these_settings():
    assert SecondaryTierFactory.get_tier_class({"type": "mooncake"}) is MooncakeTier
    assert MooncakeTier.settings_class is MooncakeSettings


def test_the_defaults_and_the_derived_values_are_filled_in_once():
    settings = MooncakeTier.settings_for(context(job_timeout_s=12.0), {})
    assert settings.master_server_address == "127.0.0.1:50051"
    assert settings.metadata_server == "http://127.0.0.1:8080/metadata"
    assert settings.protocol == "tcp" and settings.device_name == ""
    assert settings.global_segment_size == DEFAULT_GLOBAL_SEGMENT_SIZE
    assert settings.local_hostname  # this machine's name
    assert settings.object_bytes == HEADER_BYTES + CHUNK
    assert settings.job_deadline_s == pytest.approx(8.0)  # two thirds of job_timeout_s


def test_the_transport_s_progress_timeout_follows_the_deadline_unless_the_environment_sets_it(
    monkeypatch,
):
    assert MooncakeTier.settings_for(context(), {"job_deadline_s": 7.5}).tcp_progress_timeout_s == 7
    monkeypatch.setenv(PROGRESS_TIMEOUT_VARIABLE, "45")
    assert MooncakeTier.settings_for(context(), {}).tcp_progress_timeout_s == 45
    monkeypatch.setenv(PROGRESS_TIMEOUT_VARIABLE, "soon")
    with pytest.raises(ConfigError, match=rf"{PROGRESS_TIMEOUT_VARIABLE} must be a whole number"):
        MooncakeTier.settings_for(context(), {})


def test_a_deadline_at_or_beyond_the_job_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.job_deadline_s: must be below"):
        MooncakeTier.settings_for(context(job_timeout_s=5.0), {"job_deadline_s": 5})


def test_a_mooncake_json_fills_in_the_keys_not_given(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "10.0.0.5",
                "metadata_server": "http://10.0.0.9:8080/metadata",
                "global_segment_size": 1 << 28,
                "protocol": "rdma",
                "device_name": "mlx5_0",
                "master_server_address": "10.0.0.9:50051",
                "master_metrics_port": 9003,  # the master's key: not the tier's
            }
        )
    )
    given = {"config_path": str(path), "protocol": "tcp"}
    settings = MooncakeTier.settings_for(context(), given)
    assert settings.protocol == "tcp"  # the tier's own parameter wins
    assert settings.master_server_address == "10.0.0.9:50051"
    assert settings.local_hostname == "10.0.0.5"
    assert settings.global_segment_size == 1 << 28 and settings.device_name == "mlx5_0"


def test_mooncake_config_path_names_the_file_when_config_path_does_not(tmp_path, monkeypatch):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.7:50051"}))
    monkeypatch.setenv(CONFIG_PATH_VARIABLE, str(path))
    settings = MooncakeTier.settings_for(context(), {})
    assert settings.config_path == str(path)
    assert settings.master_server_address == "10.0.0.7:50051"


def test_checking_a_configuration_opens_no_file_and_building_names_a_bad_one(tmp_path):
    missing = tmp_path / "nowhere.json"
    MooncakeSettings.from_params({"config_path": str(missing)}, PATH)  # opens nothing
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.config_path: cannot read"):
        MooncakeTier.settings_for(context(), {"config_path": str(missing)})
    bad = tmp_path / "mooncake.json"
    bad.write_text(json.dumps({"protocol": "carrier-pigeon"}))
    with pytest.raises(ConfigError, match=r"config_path\[.*mooncake\.json\]\.protocol: expected"):
        MooncakeTier.settings_for(context(), {"config_path": str(bad)})


def test_kvtier_plan_shows_every_effective_value_the_file_s_included(tmp_path, capsys):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.9:50051"}))
    tiers = [{"type": "mooncake", "config_path": str(path), "local_hostname": "10.0.0.5"}]
    args = ["plan", "--kv-bytes-per-block", str(CHUNK), "--json"]
    args += ["--set", "spec_name=TieringOffloadingSpec", "--set", f"cpu_bytes_to_use={8 * CHUNK}"]
    assert main([*args, "--set", f"secondary_tiers={json.dumps(tiers)}"]) == 0
    [plan] = json.loads(capsys.readouterr().out)["tiers"]
    assert plan["settings"] == {
        "master_server_address": "10.0.0.9:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "local_hostname": "10.0.0.5",
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": DEFAULT_GLOBAL_SEGMENT_SIZE,
        "local_buffer_size": 16 << 20,
        "config_path": str(path),
        "io_threads": 4,
        "connect_timeout_s": 2.0,
        "job_deadline_s": 20.0,
        "object_bytes": HEADER_BYTES + CHUNK,
        "tcp_progress_timeout_s": 20,
    }


async def test_start_names_the_master_when_nothing_answers():
    mooncake = tier(context(), master_server_address=f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(
        ConfigError, match=r"^secondary_tiers\[0\]\.master_server_address: nothing answers"
    ):
        await mooncake.start()
    assert time.monotonic() - started < WAIT_S
    await mooncake.aclose()


async def test_start_names_the_metadata_server_when_it_does_not_answer():
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a master that accepts
        master = f"127.0.0.1:{listener.getsockname()[1]}"
        metadata = f"http://127.0.0.1:{free_port()}/metadata"
        mooncake = tier(context(), master_server_address=master, metadata_server=metadata)
        with pytest.raises(
            ConfigError, match=r"^secondary_tiers\[0\]\.metadata_server: nothing answers"
        ):
            await mooncake.start()
        await mooncake.aclose()


# ------------------------------------------------------------ a real master


async def test_a_damaged_object_is_counted_removed_and_never_served_by_a_fixed_depth():
    async with MooncakeMaster() as master, RawStore(master) as raw:
        ctx = context()
        params = {k: v for k, v in mooncake_tier(master).items() if k != "type"}
        mooncake = tier(ctx, **params, io_threads=3)
        await mooncake.start()
        try:
            for direction in ("read", "write"):
                labels = {"tier": ctx.tier_name, "direction": direction}
                assert ctx.metrics.sample(Names.TIER_IO_DEPTH, labels) == 3
            ks = keys("damaged", 3)
            for slot in range(3):
                ctx.primary_view[slot][:] = bytes([slot + 1]) * CHUNK
            assert (await mooncake.store(job(1, ks, [0, 1, 2], promotion=False))).success
            for key, how in zip(ks, ["flip_payload", "truncate", "append"], strict=True):
                name = mooncake.object_name(key)
                data = await raw.read(name)
                assert data is not None and data[HEADER_BYTES:] == bytes(
                    ctx.primary_view[ks.index(key)]
                )
                await raw.write(name, damaged(data, how))
            ctx.primary_view[3][:] = bytes(CHUNK)
            for key in ks:
                result = await mooncake.load(job(2, [key], [3], promotion=True))
                assert not result.success and list(result.successful_keys or ()) == []
            assert ctx.counters.integrity_failures == 3
            # Removed, so stored whole again next time; never served meanwhile.
            assert list(await mooncake.lookup(ks)) == [False, False, False]
            for key in ks:
                assert await raw.read(mooncake.object_name(key)) is None
        finally:
            await mooncake.aclose()


@pytest.mark.slow
async def test_a_master_killed_mid_run_is_a_counted_miss_and_serves_again_once_restarted(
    engine_id,
):
    async with MooncakeMaster() as master:
        config = tiering_config(
            engine_id, [mooncake_tier(master)], chunks=8, kv_bytes_per_block=CHUNK
        )
        generator = torch.Generator().manual_seed(3)
        cache = torch.randint(0, 256, (64, CHUNK), dtype=torch.uint8, generator=generator)
        async with KVTier(config, [cache]) as kv:
            before, during = keys("before", 4), keys("during", 4)
            await store_all(kv, before)
            await kv.reset()
            await master.kill()
            assert await kv.lookup(before, "down", timeout=WAIT_S) == 0
            kv.finish("down")
            await store_all(kv, during, first_block=10)
            assert failures(kv, Names.LOOKUP_FAILURES) + failures(kv, Names.PROMOTION_JOB_FAILURES)
            assert failures(kv, Names.CASCADE_JOB_FAILURES) >= 1
            # Back on the same ports, empty: what the dead master knew is a plain miss.
            await master.start()
            await kv.reset()
            assert await kv.lookup(before + during, "gone", timeout=WAIT_S) == 0
            kv.finish("gone")
            # The client mounts its segment again on its own; then the tier serves.
            after = await _stored_once_served(kv, cache)
            assert failures(kv, Names.INTEGRITY_FAILURES) == 0
            assert await kv.load(after, [40, 41, 42, 43], "back") == 4
            kv.finish("back")
            assert torch.equal(cache[40:44], cache[20:24])


async def _stored_once_served(kv: KVTier, cache: torch.Tensor) -> list[bytes]:
    """Store 4 fresh chunks (blocks 20..23) until a lookup finds them all (the request
    ``back`` left open); their keys."""
    with anyio.fail_after(WAIT_S):
        attempt = 0
        while True:
            attempt += 1
            after = keys(f"after-{attempt}", 4)
            await store_all(kv, after, first_block=20)
            await kv.reset()
            if await kv.lookup(after, "back", timeout=WAIT_S) == 4:
                return after
            kv.finish("back")
            await anyio.sleep(0.5)


def _spawn(target: Any, *args: Any) -> tuple[multiprocessing.Process, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    child.close()
    return process, parent


async def _answer(conn: Any, what: str) -> Any:
    if not await anyio.to_thread.run_sync(conn.poll, WAIT_S):
        raise AssertionError(f"no answer from the process to {what} within {WAIT_S} s")
    return conn.recv()


@pytest.mark.slow
async def test_the_node_lending_a_chunks_segment_killed_is_a_counted_miss_without_a_hang(
    engine_id,
):
    async with MooncakeMaster() as master:
        lender, conn = _spawn(
            mooncake_procs.lend_segment, master.address, master.metadata_server, SEGMENT_BYTES
        )
        try:
            assert await _answer(conn, "set up") == ("ready", 0)
            # This engine lends nothing: every chunk it stores lives in the lender's segment.
            tier_params = mooncake_tier(master, global_segment_size=0)
            config = tiering_config(engine_id, [tier_params], chunks=8, kv_bytes_per_block=CHUNK)
            cache = torch.randint(
                0, 256, (64, CHUNK), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
            )
            async with KVTier(config, [cache]) as kv:
                stored = keys("lent", 4)
                await store_all(kv, stored)
                await kv.reset()
                assert await kv.lookup(stored, "alive", timeout=WAIT_S) == 4
                kv.finish("alive")
                await kv.reset()
                lender.kill()
                await anyio.to_thread.run_sync(lender.join, WAIT_S)
                cache[40:44] = 0
                started = time.monotonic()
                hits = await kv.lookup(stored, "dead", timeout=WAIT_S)
                if hits:
                    assert await kv.load(stored[:hits], list(range(40, 40 + hits)), "dead") == 0
                kv.finish("dead")
                assert time.monotonic() - started < WAIT_S
                assert hits == 0
                assert torch.count_nonzero(cache[40:44]) == 0, "bytes of a lost chunk were served"
                assert failures(kv, Names.PROMOTION_JOB_FAILURES) >= 1
                assert failures(kv, Names.INTEGRITY_FAILURES) == 0
        finally:
            lender.kill()
            lender.join(WAIT_S)


@pytest.mark.slow
async def test_a_node_that_stops_answering_is_a_miss_within_the_deadline_then_serves_again(
    engine_id,
):
    async with MooncakeMaster() as master:
        lender, conn = _spawn(
            mooncake_procs.lend_segment, master.address, master.metadata_server, SEGMENT_BYTES
        )
        try:
            assert await _answer(conn, "set up") == ("ready", 0)
            # The deadline far below the framework's time-out: the tier's transport ends
            # the stalled transfer itself (so the framework never gives the job up).
            tier_params = mooncake_tier(
                master, global_segment_size=0, job_deadline_s=2, job_timeout_s=30
            )
            config = tiering_config(engine_id, [tier_params], chunks=8, kv_bytes_per_block=CHUNK)
            cache = torch.randint(
                0, 256, (64, CHUNK), dtype=torch.uint8, generator=torch.Generator().manual_seed(6)
            )
            async with KVTier(config, [cache]) as kv:
                stored = keys("paused", 4)
                await store_all(kv, stored)
                await kv.reset()
                os.kill(lender.pid, signal.SIGSTOP)
                try:
                    cache[40:44] = 0
                    assert await kv.lookup(stored, "paused", timeout=WAIT_S) == 0
                    kv.finish("paused")
                    assert torch.count_nonzero(cache[40:44]) == 0
                    assert failures(kv, Names.PROMOTION_JOB_FAILURES) >= 1
                    assert failures(kv, Names.LATE_COMPLETIONS) == 0, "the framework timed it out"
                finally:
                    os.kill(lender.pid, signal.SIGCONT)
                await kv.reset()
                # The first transfer after the stall may still meet a connection the
                # stall broke (Mooncake's transport drops it only then): a counted miss,
                # like any failed transfer. The node serves again right after it.
                for attempt in range(3):
                    req = f"resumed-{attempt}"
                    if await kv.lookup(stored, req, timeout=WAIT_S) == 4:
                        break
                    kv.finish(req)
                else:
                    raise AssertionError("the node never served again")
                assert await kv.load(stored, [40, 41, 42, 43], req) == 4
                kv.finish(req)
                assert torch.equal(cache[40:44], cache[0:4])
        finally:
            lender.kill()
            lender.join(WAIT_S)


@pytest.mark.slow
async def test_engines_in_two_processes_share_one_pool_and_another_model_sees_none(engine_id):
    async with MooncakeMaster() as master:
        tier_params = mooncake_tier(master)
        a, to_a = _spawn(mooncake_procs.engine, f"{engine_id}-a", tier_params, "shared", 7)
        b, to_b = _spawn(mooncake_procs.engine, f"{engine_id}-b", tier_params, "shared", 8)
        try:
            assert await _answer(to_a, "start") == ("ready",)
            assert await _answer(to_b, "start") == ("ready",)
            count = 12
            to_a.send(("store", "from-a", count))
            assert await _answer(to_a, "store") == ("stored", count)
            to_b.send(("read", "from-a", count, 7))
            assert await _answer(to_b, "read") == ("read", count, count, True)
            to_b.send(("store", "from-b", count))
            assert await _answer(to_b, "store") == ("stored", count)
            to_a.send(("read", "from-b", count, 8))
            assert await _answer(to_a, "read") == ("read", count, count, True)
            # Another model's engine, on the same pool, finds none of them.
            config = tiering_config(
                engine_id, [tier_params], chunks=8, kv_bytes_per_block=CHUNK, model_name="other"
            )
            async with KVTier(config, [torch.zeros(64, CHUNK, dtype=torch.uint8)]) as other:
                both = keys("from-a", count)[:4] + keys("from-b", count)[:4]
                assert await other.lookup(both, "other", timeout=WAIT_S) == 0
                other.finish("other")
            for conn in (to_a, to_b):
                conn.send(("exit",))
                assert await _answer(conn, "exit") == ("bye",)
        finally:
            for process in (a, b):
                process.join(WAIT_S)
                if process.is_alive():
                    process.kill()
                    process.join(WAIT_S)
