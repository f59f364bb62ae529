"""The p2p tier over real TCP: engines in spawned processes, raw-socket peers, TLS."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import p2p_procs
import pytest
import torch
import trustme
from flipping_proxy import FlippingProxy
from helpers import keys
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from p2p_procs import (
    BLOCK,
    SECRET,
    TIMEOUT_S,
    RawReader,
    counter,
    node_config,
    p2p_tier,
    peer_tier,
    wait_until,
)
from prometheus_client import generate_latest

from kvtier import ConfigError, KVTier, OffloadingSpecFactory, ReqContext
from kvtier._secrets import Secret
from kvtier.format import HEADER_BYTES, ChunkFormat
from kvtier.metrics import Names
from kvtier.tiers.p2p import (
    ANNOUNCE_BYTES,
    ANNOUNCE_FRAMES,
    ANNOUNCE_KEYS,
    AUTH_FAILURES,
    FRAMES_REJECTED,
    INDEX_MEMORY,
    REVERIFIED_CHUNKS,
    PeerTier,
)
from kvtier.tiers.p2p.handshake import encode_hello
from kvtier.tiers.p2p.wire import FRAME, Kind, encode_fetch

pytestmark = pytest.mark.anyio

SPAWN = multiprocessing.get_context("spawn")
WRONG_SECRET = "not-the-cluster-secret-but-long-enough"


class Node:
    """A kvtier engine in a spawned process, driven over a pipe; every wait is bounded."""

    def __init__(self, engine_id: str, seed: int) -> None:
        self.engine_id = engine_id
        self.seed = seed
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=p2p_procs.node, args=(engine_id, seed, child))
        self.proc.start()
        child.close()
        self.address = ""

    def configure(self, **tier: Any) -> Node:
        """Open the engine with a p2p tier of these parameters; wait until it listens."""
        self.conn.send(p2p_tier(**tier))
        ready, self.address = self._recv("start")
        assert ready == "ready"
        return self

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        return self._recv(command[0])

    def status(self) -> dict[str, Any]:
        return self.ask("status")  # type: ignore[no-any-return]

    def wait_status(self, predicate: Any, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if predicate(status) or time.monotonic() > deadline:
                return status
            time.sleep(0.05)

    def _recv(self, what: str) -> Any:
        assert self.conn.poll(TIMEOUT_S), f"node {self.engine_id} did not answer {what!r}"
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.proc.join(TIMEOUT_S)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.proc.join(TIMEOUT_S)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


@pytest.fixture
def nodes():
    """Start engines in processes; they are stopped (or killed) when the test ends."""
    started: list[Node] = []

    def start(engine_id: str, seed: int = 0) -> Node:
        node = Node(engine_id, seed)
        started.append(node)
        return node

    yield start
    for node in started:
        node.close()
    for node in started:
        assert node.proc.exitcode in (0, -signal.SIGKILL), f"{node.engine_id} crashed"


def in_process_config(engine_id: str, **tier: Any):
    return node_config(engine_id, p2p_tier(**tier))


def zeros() -> torch.Tensor:
    return torch.zeros((p2p_procs.GPU_BLOCKS, BLOCK), dtype=torch.uint8)


# ------------------------------------------------------------ engines sharing


@pytest.mark.slow
def test_chunks_stored_on_one_engine_are_loaded_byte_exact_by_another(engine_id, nodes):
    owner, reader = nodes(f"{engine_id}-o", seed=1), nodes(f"{engine_id}-r", seed=2)
    owner.configure()
    reader.configure(peers=[owner.address])
    assert owner.ask("store", "shared", 6, 0) == 6
    assert reader.ask("wait_indexed", "shared", 6, True, 30)
    loaded, got, _ = reader.ask("fetch", "shared", 6, 10, "r1", 30)
    assert loaded == 6
    assert got == owner.ask("digest", 0, 6)
    served = owner.status()
    assert served["inbound"] == 1 and served["announced"] == 6


@pytest.mark.slow
def test_three_engines_each_chunk_comes_from_whichever_holds_it_and_evictions_are_heard(
    engine_id, nodes
):
    a, c, b = (nodes(f"{engine_id}-{n}", seed=s) for n, s in (("a", 1), ("c", 3), ("b", 2)))
    a.configure()
    c.configure(peers=[a.address])
    b.configure(peers=[a.address, c.address])
    assert a.ask("store", "from-a", 4, 0) == 4
    assert c.ask("store", "from-c", 4, 8) == 4
    assert b.ask("wait_indexed", "from-a", 4, True, 30)
    assert b.ask("wait_indexed", "from-c", 4, True, 30)
    assert c.ask("wait_indexed", "from-a", 4, True, 30)
    from_a, from_c = a.ask("digest", 0, 4), c.ask("digest", 8, 4)
    assert b.ask("fetch", "from-a", 4, 20, "b1", 30)[:2] == (4, from_a)
    assert b.ask("fetch", "from-c", 4, 30, "b2", 30)[:2] == (4, from_c)
    assert c.ask("fetch", "from-a", 4, 20, "c1", 30)[:2] == (4, from_a)
    # 16 newer chunks push the four old ones out of a's 16-slot primary tier.
    assert a.ask("store", "newer", 16, 40) == 16
    assert b.ask("wait_indexed", "from-a", 4, False, 30)
    assert c.ask("wait_indexed", "from-a", 4, False, 30)
    assert b.ask("wait_indexed", "newer", 16, True, 30)


@pytest.mark.slow
def test_a_node_with_the_wrong_secret_learns_nothing_and_the_others_keep_working(engine_id, nodes):
    a, w, b = (nodes(f"{engine_id}-{n}", seed=s) for n, s in (("a", 1), ("w", 4), ("b", 2)))
    a.configure()
    w.configure(peers=[a.address], secret=WRONG_SECRET)
    b.configure(peers=[a.address, w.address])
    assert a.ask("store", "guarded", 4, 0) == 4
    assert b.ask("wait_indexed", "guarded", 4, True, 30)
    assert b.ask("fetch", "guarded", 4, 10, "b1", 30)[:2] == (4, a.ask("digest", 0, 4))
    # w has tried (and failed) to read from a, and b to read from w.
    assert a.wait_status(lambda s: s["auth_failures"] >= 1)["auth_failures"] >= 1
    assert w.wait_status(lambda s: s["auth_failures"] >= 1)["auth_failures"] >= 1
    spurned = w.status()
    assert spurned["connected"] == [] and spurned["indexed"] == 0 and spurned["inbound"] == 0
    assert w.ask("fetch", "guarded", 4, 10, "w1", 2)[0] == 0
    assert b.status()["connected"] == [a.address]
    assert a.status()["inbound"] == 1  # b only


# ----------------------------------------------------------------- impostors


@contextlib.contextmanager
def impostor(mode: str, port: int = 0):
    conn, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=p2p_procs.impostor, args=(mode, port, child))
    proc.start()
    child.close()
    try:
        assert conn.poll(TIMEOUT_S), "the impostor did not start"
        ready, bound = conn.recv()
        assert ready == "ready"
        yield conn, bound, proc
    finally:
        if proc.is_alive():
            conn.send("exit")
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT_S)
        conn.close()


async def recv_from(conn, what: str) -> Any:
    ready = await asyncio.to_thread(conn.poll, TIMEOUT_S)
    assert ready, f"timed out waiting for {what}"
    return conn.recv()


async def indexed(tier: PeerTier, ks, present: bool = True, timeout: float = 30) -> bool:
    return await wait_until(lambda: all(tier.contains(k) is present for k in ks), timeout)


@pytest.mark.slow
async def test_a_corrupted_chunk_on_the_wire_is_caught_counted_and_never_served(engine_id):
    ks = keys("flipped", 2)
    with impostor("flip") as (conn, port, _):
        config = in_process_config(engine_id, peers=[f"127.0.0.1:{port}"])
        cache = zeros()
        async with KVTier(config, [cache]) as kv:
            tier = peer_tier(kv)
            conn.send((tier.ctx.namespace, tier.ctx.chunk_bytes, ks))
            assert await recv_from(conn, "announcements") == "announced"
            assert await indexed(tier, ks)
            assert await kv.lookup(ks, "r", timeout=30) == 0
            assert await kv.load(ks, [0, 1], "r") == 0
            assert not cache.any()
            assert counter(kv, Names.INTEGRITY_FAILURES) == 2
            assert await recv_from(conn, "answers") == "answered"


async def test_an_engine_misses_chunks_damaged_on_the_wire_then_hits_them_once_the_link_heals(
    engine_id,
):
    """As a user sees it: no new announcement, no restart, the key comes back."""
    source = p2p_procs.pattern(3)
    owner = KVTier(in_process_config(f"{engine_id}-a"), [source])
    async with owner as a, FlippingProxy(peer_tier(a).address) as proxy:
        config = in_process_config(
            f"{engine_id}-b", peers=[proxy.address], retry_corrupt_after_s=0.1
        )
        cache = zeros()
        async with KVTier(config, [cache]) as b:
            tier = peer_tier(b)
            assert await wait_until(lambda: tier.connected_peers == [proxy.address], 30)
            ks = keys("healed", 2)
            assert await a.store(ks, [0, 1], "w") == 2
            await a.drain()
            assert await indexed(tier, ks)
            proxy.always = True
            assert await b.lookup(ks, "r1", timeout=30) == 0
            b.finish("r1")
            assert counter(b, Names.INTEGRITY_FAILURES) >= 1
            proxy.always = False  # the link heals
            assert await indexed(tier, ks)  # once the back-off runs out
            assert await b.lookup(ks, "r2", timeout=30) == 2
            assert await b.load(ks, [5, 6], "r2") == 2
            b.finish("r2")
            assert torch.equal(cache[5:7], source[0:2])
            labels = {"tier": b.manager.diagnostics.tier_labels[0]}
            received = b.manager.metrics.sample(
                f"{ANNOUNCE_FRAMES}_total", {**labels, "flow": "received", "change": "announce"}
            )
            assert received == 1  # the key was never announced again
            verdict = {"tier": a.manager.diagnostics.tier_labels[0], "verdict": "intact"}
            # The owner found its rows intact: it kept announcing the keys.
            assert await wait_until(
                lambda: (a.manager.metrics.sample(f"{REVERIFIED_CHUNKS}_total", verdict) or 0) >= 1
            )


@pytest.mark.slow
async def test_a_chunk_the_owner_no_longer_holds_is_a_miss_and_leaves_the_index(engine_id):
    ks = keys("gone", 3)
    with impostor("missing") as (conn, port, _):
        config = in_process_config(engine_id, peers=[f"127.0.0.1:{port}"])
        async with KVTier(config, [zeros()]) as kv:
            tier = peer_tier(kv)
            conn.send((tier.ctx.namespace, tier.ctx.chunk_bytes, ks))
            assert await recv_from(conn, "announcements") == "announced"
            assert await indexed(tier, ks)
            assert await kv.lookup(ks, "r", timeout=30) == 0
            assert not any(tier.contains(k) for k in ks)
            assert tier.connected_peers == [f"127.0.0.1:{port}"]  # a miss is no fault
            assert counter(kv, Names.INTEGRITY_FAILURES) == 0


@pytest.mark.slow
async def test_a_peer_killed_mid_transfer_is_a_miss_and_a_restarted_peer_resyncs(engine_id, nodes):
    doomed, fresh = keys("doomed", 2), keys("fresh", 2)
    restarted = nodes(f"{engine_id}-again", seed=5)  # imports torch while the rest runs
    with impostor("stall") as (conn, port, proc):
        address = f"127.0.0.1:{port}"
        cache = zeros()
        # A long io_timeout_s: the miss must come from the lost connection itself.
        config = in_process_config(engine_id, peers=[address], io_timeout_s=30)
        async with KVTier(config, [cache]) as kv:
            tier = peer_tier(kv)
            conn.send((tier.ctx.namespace, tier.ctx.chunk_bytes, doomed))
            assert await recv_from(conn, "announcements") == "announced"
            assert await indexed(tier, doomed)
            lookup = asyncio.ensure_future(kv.lookup(doomed, "r1", timeout=60))
            assert await recv_from(conn, "half a chunk") == "mid-transfer"
            killed_at = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            assert await lookup == 0
            assert time.monotonic() - killed_at < 10  # a miss at once, not a hang
            assert await indexed(tier, doomed, present=False)
            # The survivor keeps working on its own meanwhile.
            local = keys("local", 2)
            assert await kv.store(local, [40, 41], "w") == 2
            assert await kv.lookup(local, "r2", timeout=5) == 2
            kv.finish("w")
            kv.finish("r2")
            # The peer comes back on the same port with the keys: the reader redials
            # and receives the new owner's whole key set.
            restarted.configure(listen=address)
            assert restarted.ask("store", "doomed", 2, 0) == 2
            assert restarted.ask("store", "fresh", 2, 2) == 2
            assert await indexed(tier, doomed + fresh)
            assert tier.connected_peers == [address]
            assert await kv.lookup(doomed + fresh, "r3", timeout=30) == 4
            assert await kv.load(doomed + fresh, [10, 11, 12, 13], "r3") == 4
            assert p2p_procs.digest(cache, 10, 4) == restarted.ask("digest", 0, 4)
            # Killed while idle, the owner's entries go as soon as the link drops.
            restarted.kill()
            assert await indexed(tier, fresh, present=False)
            assert await kv.lookup(keys("fresh2", 1), "r4", timeout=5) == 0


# --------------------------------------------------------------------- fuzzer


FUZZ_CASES: list[tuple[bool, bytes]] = [
    (False, b"GET / HTTP/1.1\r\nHost: kvtier\r\n\r\n"),
    (False, FRAME.pack(Kind.HELLO, 1 << 62)),
    (False, FRAME.pack(Kind.FETCH, 12) + b"\0" * 12),
    (False, FRAME.pack(Kind.HELLO, 74) + encode_hello(b"n" * 16, b"r" * 32, b"d" * 16)),
    (True, FRAME.pack(Kind.FETCH, 1 << 40)),
    (True, FRAME.pack(Kind.CHUNK, 8) + b"\0" * 8),
    (True, FRAME.pack(Kind.ANNOUNCE, 4) + b"\0\0\0\1"),
    (True, FRAME.pack(Kind.FETCH, 8) + b"\0\0\0\1\xff\xff\xff\xff"),
    (True, bytes([Kind.FETCH, 0, 7, 0]) + (8).to_bytes(8, "big") + b"\0" * 8),
    (True, FRAME.pack(Kind.PROOF, 32) + b"\0" * 32),
]


def poke(address: str, authenticate: bool, namespace: str, payload: bytes) -> None:
    """Send ``payload`` (after a valid handshake if asked), then read until the owner hangs up."""
    with RawReader(address, timeout=10) as raw:
        if authenticate:
            raw.handshake(SECRET, namespace)
        try:
            raw.sock.sendall(payload)
            raw.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return  # the owner hung up before reading it all: that is a pass
        # The owner must hang up now; a timeout here fails the test.
        with contextlib.suppress(ConnectionError):
            while raw.sock.recv(1 << 16):
                pass


def frames() -> st.SearchStrategy[bytes]:
    kinds = st.one_of(st.sampled_from([int(k) for k in Kind]), st.integers(0, 255))
    lengths = st.one_of(st.integers(0, 400), st.integers(0, (1 << 64) - 1))
    pads = st.sampled_from([b"\0\0\0", b"\0\x01\0", b"\xff\xff\xff"])
    bodies = st.binary(max_size=400)
    frame = st.builds(
        lambda kind, pad, length, body: bytes([kind]) + pad + length.to_bytes(8, "big") + body,
        kinds,
        pads,
        lengths,
        bodies,
    )
    fetch = st.builds(
        lambda request, ks: encode_fetch(request, ks),
        st.integers(0, (1 << 32) - 1),
        st.lists(st.binary(min_size=1, max_size=48), max_size=4),
    ).map(lambda body: FRAME.pack(Kind.FETCH, len(body)) + body)
    truncated = st.builds(lambda f, cut: f[:cut], fetch, st.integers(0, 60))
    return st.one_of(
        st.binary(min_size=1, max_size=600),
        frame,
        fetch,
        truncated,
        st.lists(frame, min_size=2, max_size=4).map(b"".join),
    )


@pytest.mark.slow
def test_malformed_frames_never_crash_the_server_and_it_keeps_serving(engine_id, nodes):
    server = nodes(f"{engine_id}-s", seed=6)
    server.configure()
    assert server.ask("store", "fuzz", 2, 0) == 2
    namespace, chunk_bytes = p2p_procs.namespace_of(node_config(server.engine_id, p2p_tier()))

    for authenticate, payload in FUZZ_CASES:
        poke(server.address, authenticate, namespace, payload)

    @settings(
        max_examples=120,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(authenticate=st.booleans(), payload=frames())
    def fuzz(authenticate: bool, payload: bytes) -> None:
        poke(server.address, authenticate, namespace, payload)
        tried.append(payload)

    tried: list[bytes] = []
    fuzz()
    assert len(tried) >= 100
    assert server.proc.is_alive()
    status = server.wait_status(lambda s: s["inbound"] == 0)
    assert status["auth_failures"] > 0 and status["frames_rejected"] > 0
    # A well-behaved reader still gets verified chunks, byte for byte.
    expected = p2p_procs.pattern(6)[0:2].numpy()
    wanted = keys("fuzz", 2)
    with RawReader(server.address) as raw:
        raw.handshake(SECRET, namespace)
        answers = raw.fetch(7, wanted, chunk_bytes)
    chunk_format = ChunkFormat(namespace)
    for position, key in enumerate(wanted):
        header, payload = answers[position][:HEADER_BYTES], answers[position][HEADER_BYTES:]
        assert chunk_format.verify(header, key, memoryview(payload)) is None
        assert payload == expected[position].tobytes()


# ------------------------------------------------------------------------ TLS


def tls_files(tmp_path: Path, name: str, issuer: trustme.CA, trusted: trustme.CA) -> dict:
    cert = issuer.issue_cert("127.0.0.1", "localhost")
    paths = {part: tmp_path / f"{name}-{part}.pem" for part in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    trusted.cert_pem.write_to_path(paths["ca"])
    return {part: str(path) for part, path in paths.items()}


@pytest.mark.slow
async def test_tls_round_trip_and_peers_without_a_valid_certificate_are_refused(
    engine_id, nodes, tmp_path
):
    cluster, stranger = trustme.CA(), trustme.CA()
    owner = nodes(f"{engine_id}-o", seed=7)
    owner.configure(tls=tls_files(tmp_path, "owner", cluster, cluster))
    assert owner.ask("store", "sealed", 3, 0) == 3
    ks = keys("sealed", 3)
    peers = [owner.address]
    good = in_process_config(
        f"{engine_id}-g", peers=peers, tls=tls_files(tmp_path, "good", cluster, cluster)
    )
    # Trusts the owner, but its own certificate comes from another authority.
    forged = in_process_config(
        f"{engine_id}-f", peers=peers, tls=tls_files(tmp_path, "forged", stranger, cluster)
    )
    plain = in_process_config(f"{engine_id}-p", peers=peers)
    cache = zeros()
    async with (
        KVTier(good, [cache]) as reader,
        KVTier(forged, [zeros()]) as forger,
        KVTier(plain, [zeros()]) as stranger_kv,
    ):
        tier = peer_tier(reader)
        assert await indexed(tier, ks)
        assert await reader.lookup(ks, "r", timeout=30) == 3
        assert await reader.load(ks, [20, 21, 22], "r") == 3
        assert p2p_procs.digest(cache, 20, 3) == owner.ask("digest", 0, 3)
        refused = await asyncio.to_thread(owner.wait_status, lambda s: s["auth_failures"] >= 2)
        assert refused["auth_failures"] >= 2 and refused["inbound"] == 1
        for kv in (forger, stranger_kv):
            assert peer_tier(kv).connected_peers == [] and peer_tier(kv).indexed_keys == 0
            assert await kv.lookup(ks, "x", timeout=2) == 0


# ---------------------------------------------------------- one process, two


async def test_a_synchronous_host_announces_and_withdraws_from_its_own_thread(engine_id):
    """The scheduler thread calls contains() and on_primary_removed(), not the loop."""
    owner_spec = OffloadingSpecFactory.create_spec(in_process_config(f"{engine_id}-o"))
    owner = await asyncio.to_thread(owner_spec.get_manager)
    try:
        assert owner.owns_loop
        address = owner.tiers[0].listen_address  # type: ignore[attr-defined]
        config = in_process_config(f"{engine_id}-r", peers=[address])
        async with KVTier(config, [zeros()]) as kv:
            tier = peer_tier(kv)
            ks = keys("sync", 3)
            req = ReqContext("w")
            out = owner.prepare_store(ks, req)
            assert out is not None
            rows = owner.region.primary_view
            for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                rows[slot][:] = hashlib.sha256(key).digest() * (len(rows[slot]) // 32)
            owner.complete_store(ks, req)
            assert await indexed(tier, ks)
            assert await kv.lookup(ks, "r", timeout=30) == 3
            view = kv.manager.region.primary_view
            spec = kv.manager.prepare_load(ks, ReqContext("check"))
            for key, slot in zip(ks, spec.chunk_ids, strict=True):
                assert bytes(view[slot]) == hashlib.sha256(key).digest() * (BLOCK // 32)
            kv.manager.complete_load(ks, ReqContext("check"))
            await asyncio.to_thread(owner.reset_cache)
            assert await indexed(tier, ks, present=False)
    finally:
        await asyncio.to_thread(owner_spec.shutdown)


async def test_closing_leaves_no_task_and_no_socket_behind(engine_id):
    before = asyncio.all_tasks()
    async with KVTier(in_process_config(f"{engine_id}-a"), [zeros()]) as a:
        peers = [peer_tier(a).listen_address]
        async with KVTier(in_process_config(f"{engine_id}-b", peers=peers), [zeros()]) as b:
            assert await wait_until(lambda: peer_tier(b).connected_peers == peers, 30)
            assert await wait_until(lambda: peer_tier(a).inbound_peers == 1, 30)
            ks = keys("bye", 2)
            assert await a.store(ks, [0, 1], "w") == 2
            await a.drain()
            assert await indexed(peer_tier(b), ks)
    gc.collect()  # an unclosed socket would warn here, which this suite turns into an error
    assert asyncio.all_tasks() - before == set()


# --------------------------------------------------------------- configuration


SECRET_VALUE = "Sup3r-Secret-Value-Never-To-Be-Shown"


def test_a_bad_setting_stops_the_spec_naming_its_key_and_never_the_secret(engine_id):
    """Every case is in test_settings; this one shows the spec reports them."""
    tier = {"type": "p2p", "secret": SECRET_VALUE, "secrte": "typo"}
    with pytest.raises(ConfigError) as caught:
        OffloadingSpecFactory.create_spec(node_config(engine_id, tier))
    assert caught.value.path == "secondary_tiers[0].secrte"
    assert SECRET_VALUE not in str(caught.value)


def test_a_secret_file_readable_by_others_is_refused(engine_id, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET_VALUE + "\n")
    path.chmod(0o644)
    spec = OffloadingSpecFactory.create_spec(
        node_config(engine_id, p2p_tier(secret_file=str(path)))
    )
    with pytest.raises(ConfigError) as caught:
        spec.get_manager()
    message = str(caught.value)
    assert message.startswith("secondary_tiers[0].secret_file: ")
    assert "group" in message and "world" in message and "chmod 600" in message
    assert SECRET_VALUE not in message


async def test_a_private_secret_file_authenticates_like_the_inline_secret(engine_id, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    async with KVTier(in_process_config(f"{engine_id}-a"), [zeros()]) as a:
        peers = [peer_tier(a).listen_address]
        config = node_config(f"{engine_id}-b", p2p_tier(secret_file=str(path), peers=peers))
        async with KVTier(config, [zeros()]) as b:
            assert await wait_until(lambda: peer_tier(b).connected_peers == peers, 30)


async def test_the_secret_never_appears_in_logs_reprs_or_metrics(engine_id, caplog):
    caplog.set_level(logging.DEBUG)
    async with KVTier(in_process_config(f"{engine_id}-a", secret=SECRET_VALUE), [zeros()]) as a:
        peers = [peer_tier(a).listen_address]
        wrong = in_process_config(f"{engine_id}-w", peers=peers, secret=SECRET_VALUE + "-nope")
        async with KVTier(wrong, [zeros()]) as w:
            assert await wait_until(lambda: counter(a, AUTH_FAILURES) >= 1, 30)
            texts = [
                caplog.text,
                repr(peer_tier(a)),
                repr(peer_tier(w)),
                repr(peer_tier(a).__dict__),
                generate_latest(a.registry).decode(),
                generate_latest(w.registry).decode(),
            ]
    assert "refused a connection" in caplog.text
    for text in texts:
        assert SECRET_VALUE not in text
    assert repr(Secret(SECRET_VALUE.encode())) == "Secret(<hidden>)"


def test_the_tier_declares_its_metrics_with_a_tier_label():
    definitions = PeerTier.build_metric_definitions({})
    for name in (AUTH_FAILURES, FRAMES_REJECTED, INDEX_MEMORY):
        assert definitions[name].labelnames == ("tier",)
    for name in (ANNOUNCE_FRAMES, ANNOUNCE_KEYS, ANNOUNCE_BYTES):
        assert definitions[name].labelnames == ("tier", "flow", "change")
