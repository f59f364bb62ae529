"""kvtier under vLLM's real Scheduler and OffloadingConnector, on CPU tensors.

Each test stores prompts through vLLM, empties vLLM's GPU prefix cache (and zeroes the
KV tensors), and runs requests sharing those prompts: every token vLLM then finds
computed was loaded by kvtier, and each one is compared byte for byte with what was
computed for it.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

# vLLM's GPU block in these tests (the engine fixture's).
TOKENS_PER_BLOCK = 16
PRIMARY_BYTES = 256 * 2 * 2048  # 256 GPU blocks of both layers


def prompt(seed: int, num_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_blocks * TOKENS_PER_BLOCK)]


def tier_config(kind: str, tmp_path) -> dict:
    if kind == "primary":
        return {"cpu_bytes_to_use": PRIMARY_BYTES}
    return {
        "cpu_bytes_to_use": PRIMARY_BYTES,
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(tmp_path / "fs"),
                "n_read_threads": 2,
                "n_write_threads": 2,
            }
        ],
    }


@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("tiers", ["primary", "fs"])
def test_a_stored_prompt_loads_back_byte_exact(
    make_engine, tmp_path, tiers, blocks_per_chunk, events
):
    extra = {**tier_config(tiers, tmp_path), "blocks_per_chunk": blocks_per_chunk}
    engine = make_engine(extra, events=events)
    shared = prompt(1, 8)
    engine.add("first", [*shared, 5, 6, 7])
    engine.run()
    if tiers == "fs":
        engine.drain_tiers()
        # Empty kvtier's primary tier too: the chunks must come back from the disk.
        engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.wipe_gpu()
    engine.add("second", [*shared, 9, 9, 9, 9])
    engine.run()
    assert engine.cached_at_start["second"] == 8 * TOKENS_PER_BLOCK
    assert engine.finished == {"first", "second"}
    stored = [e for e in engine.published_events() if type(e).__name__ == "BlockStored"]
    if not events:
        assert stored == []
        return
    # kvtier's events reach vLLM's publisher through its events tracker: the primary
    # tier's stores as CPU (local, no owner), the fs tier's as STORAGE owned by "1:fs".
    media = {(e.medium, e.locality, e.ownership) for e in stored}
    assert ("CPU", "LOCAL", None) in media
    if tiers == "fs":
        assert ("STORAGE", "LOCAL", "1:fs") in media


def test_kv_load_tiers_choose_the_tiers_a_request_loads_from(make_engine, tmp_path):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    engine = make_engine(tier_config("fs", tmp_path))
    shared = prompt(2, 8)
    engine.add("first", [*shared, 5])
    engine.run()
    engine.drain_tiers()
    engine.scheduler.reset_prefix_cache(reset_connector=True)  # the prompt is on disk only
    engine.wipe_gpu()
    # vLLM's per-request tier selection, as a client sends it: memory tiers only.
    engine.add(
        "memory only", [*shared, 6], kv_transfer_params={"kv_load_tiers": [{"medium": "cpu"}]}
    )
    engine.run()
    assert engine.cached_at_start["memory only"] == 0
    engine.wipe_gpu()
    engine.scheduler.reset_prefix_cache(reset_connector=True)
    # vLLM splits a hit by the tier each chunk came from (get_load_source) for its
    # prefix-cache stats: record what its scheduler computed.
    by_source: list[dict] = []
    connector = engine.connector
    hit_sources = connector.get_external_cache_hit_sources

    def record(request, tokens):
        by_source.append(hit_sources(request, tokens))
        return by_source[-1]

    connector.get_external_cache_hit_sources = record
    engine.add("disk", [*shared, 7], kv_transfer_params={"kv_load_tiers": [{"medium": "storage"}]})
    engine.run()
    assert engine.cached_at_start["disk"] == 8 * TOKENS_PER_BLOCK
    # Every loaded token counted as the fs tier's disk, none as unspecified.
    assert by_source == [{CacheHitSource.DISK: 8 * TOKENS_PER_BLOCK}]


def store_then_load_from_the_tiers(engine, seed: int, *, verified_here: bool = True) -> None:
    """Compute and store a prompt, empty vLLM's cache and kvtier's primary tier, and
    find all of it again in the secondary tiers, each token's bytes checked (by the
    rank in this process when ``verified_here``, else by the worker processes)."""
    shared = prompt(seed, 8)
    engine.add("first", [*shared, 5])
    engine.run()
    engine.drain_tiers()
    engine.scheduler.reset_prefix_cache(reset_connector=True)  # the primary tier too
    engine.wipe_gpu()
    engine.add("second", [*shared, 6])
    engine.run()
    assert engine.cached_at_start["second"] == 8 * TOKENS_PER_BLOCK
    if verified_here:
        assert engine.verified_blocks >= 8


def s3_tier_config(moto, bucket: str) -> dict:
    """The primary tier and an s3 tier on the loopback S3 server's ``bucket``."""
    from s3_servers import ACCESS_KEY, SECRET_KEY

    s3 = {
        "type": "s3",
        "bucket": bucket,
        "endpoint_url": moto.endpoint,
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY,
    }
    return {"cpu_bytes_to_use": PRIMARY_BYTES, "secondary_tiers": [s3]}


def test_the_s3_tier_serves_a_prompt_back_through_vllm(make_engine, moto, bucket):
    engine = make_engine(s3_tier_config(moto, bucket))
    store_then_load_from_the_tiers(engine, seed=3)


def p2p_tier_config(**tier) -> dict:
    """The primary tier and a p2p tier on loopback."""
    return {
        "cpu_bytes_to_use": PRIMARY_BYTES,
        "secondary_tiers": [
            {"type": "p2p", "secret": "kvtier-vllm-test-secret-0123456789", **tier}
        ],
    }


def serve_over_p2p(owner, make_reader, seed: int) -> Any:
    """The owner stores a prompt; a reader made with the owner's address finds all of
    it in the owner's primary tier over loopback. Returns the reader."""
    address = owner.manager.kvtier.tiers[0].listen_address
    reader = make_reader(address)
    shared = prompt(seed, 8)
    owner.add("first", [*shared, 5])
    owner.run()
    # The owner announces what its primary tier stored; the reader's lookups are
    # probes of that index, and its loads read the owner's slots over loopback.
    index = reader.manager.kvtier.tiers[0]
    deadline = time.monotonic() + 30
    while index.indexed_keys < 8:
        assert time.monotonic() < deadline, "the owner's keys never reached the reader"
        time.sleep(0.02)
    reader.add("second", [*shared, 6])
    reader.run()
    assert reader.cached_at_start["second"] == 8 * TOKENS_PER_BLOCK
    return reader


def test_the_p2p_tier_serves_one_engines_prompt_to_another(make_engine):
    owner = make_engine(p2p_tier_config(listen="127.0.0.1:0"))
    reader = serve_over_p2p(
        owner,
        lambda address: make_engine(p2p_tier_config(listen="127.0.0.1:0", peers=[address])),
        seed=4,
    )
    assert reader.verified_blocks >= 8


def test_the_p2p_tier_serves_a_tp_2_engines_canonical_prompt_to_a_tp_1_engine(
    make_engine, worker_processes
):
    # Two worker processes fill the owner's region with their heads of each canonical
    # page; the reader, one rank holding both heads, reads those rows over loopback
    # and checks every token's bytes.
    extra = {"canonical_layout": True}
    owner = make_engine(
        {**p2p_tier_config(listen="127.0.0.1:0"), **extra},
        workers=worker_processes,
        shape="sharded",
    )
    reader = serve_over_p2p(
        owner,
        lambda address: make_engine(
            {**p2p_tier_config(listen="127.0.0.1:0", peers=[address]), **extra},
            shape="sharded",
        ),
        seed=5,
    )
    assert reader.verified_blocks >= 8


def test_a_load_may_start_inside_a_chunk(make_engine):
    # Chunks of two blocks. A short request leaves the first three blocks of the
    # prompt in vLLM's GPU cache, so the long one loads from kvtier starting with the
    # second block of chunk 1.
    engine = make_engine({"cpu_bytes_to_use": PRIMARY_BYTES, "blocks_per_chunk": 2})
    shared = prompt(2, 8)
    engine.add("store", [*shared, 4])
    engine.run()
    engine.wipe_gpu()
    engine.add("short", [*shared[: 3 * TOKENS_PER_BLOCK], 8, 8])
    engine.run()
    assert engine.cached_at_start["short"] == 2 * TOKENS_PER_BLOCK  # chunk 0 from kvtier
    skips: list[int] = []
    kvtier_worker = engine.worker.connector_worker.worker.kvtier
    submit_load = kvtier_worker.submit_load

    def record(*args, skip_blocks=0):
        skips.append(skip_blocks)
        return submit_load(*args, skip_blocks=skip_blocks)

    kvtier_worker.submit_load = record
    engine.add("long", [*shared, 7, 7, 7])
    engine.run()
    assert engine.cached_at_start["long"] == 8 * TOKENS_PER_BLOCK
    assert skips == [1]


def test_preempted_requests_resume_with_their_own_bytes(make_engine):
    # 24 GPU blocks (one is vLLM's null block) hold the two 11-block prompts only
    # until they decode into a 12th block: one of them is preempted, its pending
    # stores flushed, and it comes back through the prefix cache and kvtier.
    engine = make_engine({"cpu_bytes_to_use": PRIMARY_BYTES}, num_blocks=24)
    engine.add("a", prompt(3, 11), max_tokens=24)
    engine.add("b", prompt(4, 11), max_tokens=24)
    engine.run()
    assert engine.preempted
    assert engine.finished == {"a", "b"}
    for req_id in ("a", "b"):
        assert len(engine.tokens[req_id]) == 11 * TOKENS_PER_BLOCK + 24


def test_reset_with_a_store_in_flight_reuses_its_slots_only_once_flushed(make_engine):
    engine = make_engine({"cpu_bytes_to_use": PRIMARY_BYTES})
    shared = prompt(5, 6)
    engine.add("first", [*shared, 3], max_tokens=4)
    engine.step()  # computes the prompt
    out = engine.scheduler.schedule()  # builds its store jobs: slots are being written
    jobs = engine.connector.connector_scheduler._jobs
    assert any(job.is_store for job in jobs.values())
    diagnostics = engine.manager.kvtier.diagnostics
    assert engine.scheduler.reset_connector_cache()
    assert diagnostics.quarantined_slots == 6
    engine.finish_step(out)
    connector_scheduler = engine.connector.connector_scheduler
    for _ in range(3):
        if not diagnostics.quarantined_slots:
            break
        # vLLM still waits for the workers to report the flushed store (they may be
        # writing the held slots right now): kvtier hands none of them out.
        assert connector_scheduler._reset_fence
        engine.step()
    assert diagnostics.quarantined_slots == 0
    engine.run()
    engine.wipe_gpu()
    engine.add("again", [*shared, 9, 9])
    engine.run()
    # The store after the reset put every chunk back: all six blocks load, byte-exact.
    assert engine.cached_at_start["again"] == 6 * TOKENS_PER_BLOCK


def test_hits_and_loads_keep_a_prefix_in_the_primary_tier(make_engine):
    # vLLM never calls touch(): the adapter records the use itself. The primary tier
    # holds 8 chunks; after A and B fill it, A is used again, so storing C evicts B.
    engine = make_engine({"cpu_bytes_to_use": 8 * 2 * 2048})
    prompts = {name: prompt(10 + i, 4) for i, name in enumerate("ABC")}
    for name in "AB":
        engine.add(name, prompts[name] + [1])
        engine.run()
    engine.wipe_gpu()
    engine.add("A again", prompts["A"] + [2])
    engine.run()
    assert engine.cached_at_start["A again"] == 4 * TOKENS_PER_BLOCK
    engine.add("C", prompts["C"] + [3])
    engine.run()
    engine.wipe_gpu()
    for name in "AB":
        engine.add(f"{name} last", prompts[name] + [4])
        engine.run()
    assert engine.cached_at_start["A last"] == 4 * TOKENS_PER_BLOCK
    assert engine.cached_at_start["B last"] == 0


# A hybrid model's sliding-window layers see the last 40 tokens: their group keeps
# three 16-token blocks of a request (vLLM's null block stands for the older ones).
WINDOW = 40


def record_loads(engine) -> list:
    """The kvtier worker's loads from now on: how each divided among the groups."""
    splits: list = []
    kvtier_worker = engine.worker.connector_worker.worker.kvtier
    submit_load = kvtier_worker.submit_load

    def record(*args, **kwargs):
        splits.append(kwargs.get("groups"))
        return submit_load(*args, **kwargs)

    kvtier_worker.submit_load = record
    return splits


def reload_one_prompt(engine, tiers: str, *, seed: int, num_blocks: int) -> Any:
    """Store a prompt (to the fs tier too, then empty the primary tier), empty vLLM's
    cache, and load the prompt back whole; the one load's split among the groups."""
    shared = prompt(seed, num_blocks)
    engine.add("first", [*shared, 5, 6, 7])
    engine.run()
    if tiers == "fs":
        engine.drain_tiers()
        engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.wipe_gpu()
    splits = record_loads(engine)
    engine.add("second", [*shared, 9, 9, 9, 9])
    engine.run()
    assert engine.cached_at_start["second"] == num_blocks * TOKENS_PER_BLOCK
    [split] = splits
    return split


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("tiers", ["primary", "fs"])
def test_a_hybrid_models_groups_load_back_byte_exact(
    make_engine, tmp_path, tiers, blocks_per_chunk
):
    # Each group's tokens hold bytes of their own: a chunk of one group loaded into the
    # other's blocks, or a window block missing, fails the byte check.
    extra = {**tier_config(tiers, tmp_path), "blocks_per_chunk": blocks_per_chunk}
    engine = make_engine(extra, sliding_window=WINDOW)
    split = reload_one_prompt(engine, tiers, seed=21, num_blocks=8)
    # Full attention loads all 8 blocks; the window group only the 3 it keeps, from
    # the middle of a chunk when chunks are 2 blocks (its blocks 5-7).
    assert list(split.sizes) == [8, 3]
    assert list(split.skips) == [0, 1 if blocks_per_chunk == 2 else 0]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_hybrid_model_hits_what_vllms_own_cpu_spec_hits(make_engine, blocks_per_chunk):
    # The same requests through kvtier and through vLLM's CPUOffloadingSpec (its
    # scheduler side; its worker needs a GPU): every request finds as many tokens.
    def run(extra, **kwargs):
        engine = make_engine(
            {**extra, "cpu_bytes_to_use": PRIMARY_BYTES, "blocks_per_chunk": blocks_per_chunk},
            sliding_window=WINDOW,
            **kwargs,
        )
        base = prompt(30, 9)
        engine.add("store", [*base, 1])
        engine.run()
        engine.wipe_gpu()
        longer = [*base, *prompt(31, 3)]
        for name, tokens in [
            ("all", [*base, 2, 2]),
            ("longer", [*longer, 3]),
            ("longer again", [*longer, 4, 4]),
            # The window group keeps only the chunks a load can reach: those before
            # a stored prompt's end; a prompt sharing a shorter head hits nothing.
            ("head", [*base[: 5 * TOKENS_PER_BLOCK], *prompt(32, 3)]),
            ("other", prompt(33, 4)),
        ]:
            engine.wipe_gpu()
            engine.add(name, tokens)
            engine.run()
        return engine.cached_at_start

    kvtier_hits = run({})
    vllm_hits = run({"spec_name": "CPUOffloadingSpec"}, copies=False)
    assert kvtier_hits == vllm_hits

    def whole_chunks(blocks):
        return blocks // blocks_per_chunk * blocks_per_chunk * TOKENS_PER_BLOCK

    assert kvtier_hits["all"] == kvtier_hits["longer"] == whole_chunks(9)
    assert kvtier_hits["longer again"] == whole_chunks(12)
    assert kvtier_hits["head"] == kvtier_hits["other"] == 0


@pytest.mark.parametrize(
    ("tiers", "window", "shape"),
    [
        ("primary", None, "salted"),
        ("fs", None, "salted"),
        ("s3", None, "salted"),
        ("primary", WINDOW, "salted"),
        ("fs", WINDOW, "salted"),
        ("fs", None, "mamba"),
    ],
    ids=["primary", "fs", "s3", "hybrid", "hybrid-fs", "mamba-fs"],
)
def test_two_tensor_parallel_ranks_each_load_back_their_own_bytes(
    make_engine, worker_processes, tmp_path, tiers, window, shape, request
):
    # Two worker processes, each with KV bytes of its own (salted by its rank), share
    # the engine's primary region: each copies only its column of every slot, vLLM
    # counts a job done once both reported it, and a rank that got the other's bytes,
    # or its own from another slot, fails the byte check in its process.
    if tiers == "s3":
        extra = s3_tier_config(request.getfixturevalue("moto"), request.getfixturevalue("bucket"))
    else:
        extra = tier_config(tiers, tmp_path)
    engine = make_engine(extra, workers=worker_processes, sliding_window=window, shape=shape)
    shared = prompt(41, 6)
    engine.add("first", [*shared, 5, 6, 7])
    engine.run()
    if tiers != "primary":
        engine.drain_tiers()
        engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.wipe_gpu()
    engine.add("second", [*shared, 9, 9, 9, 9])
    engine.run()
    assert engine.cached_at_start["second"] == 6 * TOKENS_PER_BLOCK
    assert engine.finished == {"first", "second"}
    # The region's rows hold both ranks' columns: twice one rank's bytes per chunk.
    spec = engine.manager.spec
    assert spec.geometry.chunk_bytes >= 2 * spec.geometry.column_bytes
    assert spec.config.world_size == 2


def shared_tier(kind: str, tmp_path, request) -> dict:
    """A secondary tier several engines share: an fs root, or an S3 bucket."""
    if kind == "s3":
        return s3_tier_config(request.getfixturevalue("moto"), request.getfixturevalue("bucket"))
    return tier_config(kind, tmp_path)


@pytest.mark.parametrize("tiers", ["fs", "s3"])
@pytest.mark.parametrize(
    ("writer_ranks", "reader_ranks", "window"),
    [(1, 2, None), (2, 1, None), (1, 2, WINDOW)],
    ids=["tp1-to-tp2", "tp2-to-tp1", "hybrid-tp1-to-tp2"],
)
def test_a_canonical_cache_written_at_one_tp_size_is_read_byte_exact_at_another(
    make_engine, worker_processes, tmp_path, request, tiers, writer_ranks, reader_ranks, window
):
    # The ranks split the model's KV heads: at TP=2 each holds one of the two heads of
    # every token. vLLM's canonical layout makes the stored chunk the same bytes at any
    # TP size, so one engine warms another of a different size from a shared fs root
    # or bucket; each rank of the reader checks its heads byte for byte.
    extra = {**shared_tier(tiers, tmp_path, request), "canonical_layout": True}

    def engine(ranks):
        workers = worker_processes if ranks == 2 else None
        return make_engine(extra, workers=workers, shape="sharded", sliding_window=window)

    shared = prompt(51, 6)
    writer = engine(writer_ranks)
    writer.add("first", [*shared, 5, 6, 7])
    writer.run()
    writer.drain_tiers()
    namespace = writer.manager.spec.namespace
    writer.close()  # the worker processes serve one engine at a time
    reader = engine(reader_ranks)
    assert reader.manager.spec.namespace == namespace
    reader.add("second", [*shared, 9, 9, 9, 9])
    reader.run()
    assert reader.cached_at_start["second"] == 6 * TOKENS_PER_BLOCK
    assert reader.finished == {"second"}


@pytest.mark.parametrize(
    ("canonical", "shape", "window"),
    [
        (True, "sharded", None),
        (False, "sharded", None),
        (True, "sharded", WINDOW),
        (False, "mla", None),
        (True, "mla", None),
    ],
    ids=["canonical", "direct", "canonical-hybrid", "mla", "mla-canonical"],
)
def test_a_tp_2_engine_finds_what_vllms_own_tiering_finds_of_a_tp_1_engines_cache(
    make_engine, worker_processes, vllm_tiering, tmp_path, canonical, shape, window
):
    # The same two engines (TP=1 stores a prompt to an fs root, TP=2 looks it up
    # there) through kvtier and through vLLM's own TieringOffloadingSpec, whose
    # worker needs a GPU: its scheduler side alone, every copy taken as done. Both
    # find the same tokens: all of them where the cache is shared across TP sizes
    # (the canonical layout), none where it is not.
    def run(extra, root, **reader):
        root.mkdir()
        extra = {**tier_config("fs", root), "canonical_layout": canonical, **extra}
        options = {"shape": shape, "sliding_window": window}
        copies = not extra.get("spec_name")
        shared = prompt(54, 6)
        writer = make_engine(extra, copies=copies, **options)
        writer.add("first", [*shared, 5, 6, 7])
        writer.run()
        writer.drain_tiers()
        writer.close()
        engine = make_engine(extra, copies=copies, **options, **reader)
        engine.add("second", [*shared, 9, 9, 9, 9])
        engine.run()
        return engine.cached_at_start["second"]

    kvtier_found = run({}, tmp_path / "kvtier", workers=worker_processes)
    vllm_found = run(vllm_tiering, tmp_path / "vllm", world_size=2)
    assert kvtier_found == vllm_found
    assert kvtier_found == (6 * TOKENS_PER_BLOCK if canonical else 0)


def test_without_the_canonical_layout_engines_of_other_tp_sizes_never_share(
    make_engine, worker_processes, tmp_path
):
    # The direct layout's bytes depend on the ranks: its namespace names them, so a
    # TP=2 engine finds nothing of what a TP=1 engine stored in the same root.
    extra = tier_config("fs", tmp_path)
    shared = prompt(52, 4)
    writer = make_engine(extra, shape="sharded")
    writer.add("first", [*shared, 5])
    writer.run()
    writer.drain_tiers()
    reader = make_engine(extra, workers=worker_processes, shape="sharded")
    reader.add("second", [*shared, 6])
    reader.run()
    assert reader.cached_at_start["second"] == 0


@pytest.mark.parametrize("canonical", [False, True], ids=["direct", "canonical"])
def test_an_mla_models_latent_is_stored_once_and_read_by_every_rank(
    make_engine, worker_processes, tmp_path, canonical
):
    # Both ranks hold the same latent KV (vLLM's replicated layout): a row holds one
    # copy, half what two ranks' columns take. In the direct layout rank 0 writes it
    # (vLLM's connector submits the store from rank 0 alone); in the canonical one
    # the ranks take turns, page by page. Both ranks load it back from disk.
    extra = {**tier_config("fs", tmp_path), "canonical_layout": canonical}
    engine = make_engine(extra, workers=worker_processes, shape="mla")
    spec = engine.manager.spec
    assert spec.config.replicated and spec.geometry.columns == 1
    assert spec.config.layout == ("canonical" if canonical else "direct")
    assert spec.geometry.column_bytes == spec.config.kv_bytes_per_block
    store_then_load_from_the_tiers(engine, seed=53, verified_here=False)


@pytest.mark.parametrize("tiers", ["primary", "fs"])
def test_a_mamba_hybrids_state_chunk_loads_back_byte_exact(make_engine, tmp_path, tiers):
    # vLLM offloads a Mamba group's state as a window of one chunk: the chunk of the
    # prefix's last token. kvtier stores and loads it beside the attention group's
    # chunks, each group's bytes its own, and the byte check covers both.
    engine = make_engine(tier_config(tiers, tmp_path), shape="mamba")
    split = reload_one_prompt(engine, tiers, seed=61, num_blocks=6)
    # Attention loads all 6 blocks, the Mamba group the one that holds the state.
    assert list(split.sizes) == [6, 1]


def test_a_mamba_hybrid_hits_what_vllms_own_tiering_hits(make_engine, vllm_tiering, tmp_path):
    # The same requests through kvtier and through vLLM's own TieringOffloadingSpec
    # (its scheduler side): every request finds as many tokens.
    def run(extra, root, **kwargs):
        root.mkdir()
        engine = make_engine({**tier_config("fs", root), **extra}, shape="mamba", **kwargs)
        base = prompt(62, 7)
        engine.add("store", [*base, 1])
        engine.run()
        engine.drain_tiers()
        engine.scheduler.reset_prefix_cache(reset_connector=True)
        for name, tokens in [
            ("all", [*base, 2, 2]),
            ("head", [*base[: 4 * TOKENS_PER_BLOCK], *prompt(63, 2)]),
            ("other", prompt(64, 3)),
        ]:
            engine.wipe_gpu()
            engine.add(name, tokens)
            engine.run()
        return engine.cached_at_start

    kvtier_hits = run({}, tmp_path / "kvtier")
    vllm_hits = run(vllm_tiering, tmp_path / "vllm", copies=False)
    assert kvtier_hits == vllm_hits
    assert kvtier_hits["all"] == 7 * TOKENS_PER_BLOCK
    # The state is kept for the end of a stored prompt only: a prompt sharing a
    # shorter head has no state to start from, through either spec.
    assert kvtier_hits["head"] == kvtier_hits["other"] == 0
