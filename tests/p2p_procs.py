"""Process bodies and raw-socket peers for the p2p tier tests.

``node`` runs a real kvtier engine (a ``KVTier`` with a p2p tier) in a spawned process
and obeys commands sent over a pipe. ``impostor`` is a hand-written owner on blocking
sockets: it passes the handshake with the right secret and then misbehaves on purpose
(a flipped payload byte, "missing" answers, or half a chunk and silence). ``RawReader``
is the reading side of the handshake on a blocking socket, for the fuzzer and for a
well-behaved reader that checks a server still works. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from helpers import keys, tiering_config

from kvtier import KVTier, OffloadingConfig, OffloadingSpecFactory
from kvtier._secrets import Secret
from kvtier.format import ChunkFormat
from kvtier.metrics import Names
from kvtier.tiers.p2p import AUTH_FAILURES, FRAMES_REJECTED, PeerTier
from kvtier.tiers.p2p.handshake import (
    PREAUTH_MAX_BODY,
    Role,
    decode_hello,
    encode_hello,
    proof,
)
from kvtier.tiers.p2p.wire import (
    CHUNK_META,
    FRAME,
    Kind,
    chunk_body_bytes,
    decode_fetch,
    encode_fetch,
    encode_key_list,
    parse_frame_header,
)

BLOCK = 16 * 1024  # bytes per GPU block and per chunk (one block per chunk)
GPU_BLOCKS = 64
CHUNKS = 16
MODEL = "p2p-test-model"
SECRET = "kvtier-p2p-test-secret-0123456789"
TIMEOUT_S = 60.0


def pattern(seed: int) -> torch.Tensor:
    """KV contents of a node: block i of seed s is the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (GPU_BLOCKS, BLOCK), dtype=torch.uint8, generator=gen)


def digest(cache: torch.Tensor, first: int, count: int) -> str:
    return hashlib.sha256(cache[first : first + count].numpy().tobytes()).hexdigest()


def p2p_tier(**params: Any) -> dict[str, Any]:
    """A p2p tier mapping with quick reconnects; ``secret`` defaults to the shared one."""
    tier: dict[str, Any] = {
        "type": "p2p",
        "reconnect_initial_s": 0.05,
        "reconnect_max_s": 0.5,
        "io_timeout_s": 5.0,
    }
    if "secret_file" not in params:
        tier["secret"] = SECRET
    tier.update(params)
    return tier


def node_config(engine_id: str, tier: dict[str, Any], chunks: int = CHUNKS) -> OffloadingConfig:
    return tiering_config(
        engine_id, [tier], chunks=chunks, kv_bytes_per_block=BLOCK, model_name=MODEL
    )


def namespace_of(config: OffloadingConfig) -> tuple[str, int]:
    """The storage namespace and chunk size an engine of ``config`` uses."""
    spec = OffloadingSpecFactory.create_spec(config)
    try:
        return spec.namespace, spec.chunk_bytes  # type: ignore[attr-defined]
    finally:
        spec.shutdown()


async def wait_until(predicate: Any, timeout: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def peer_tier(kv: KVTier) -> PeerTier:
    tier = kv.manager.tiers[0]
    assert isinstance(tier, PeerTier)
    return tier


def counter(kv: KVTier, name: str) -> float:
    label = {"tier": kv.manager.diagnostics.tier_labels[0]}
    kv.manager.on_schedule_end()  # flush the step's counts
    return kv.manager.metrics.sample(f"{name}_total", label) or 0.0


# ------------------------------------------------------------------ the node


def node(engine_id: str, seed: int, conn: Connection) -> None:
    """A kvtier engine with a p2p tier, driven by commands over ``conn``.

    The first message is the tier's mapping: the process starts (and imports torch)
    while the test still waits for the addresses of the peers it will list.
    """
    if not conn.poll(TIMEOUT_S):
        return
    tier = conn.recv()
    asyncio.run(_node(engine_id, tier, seed, conn))


async def _receive(conn: Connection, timeout: float) -> Any:
    """The next command, without blocking the loop; None after ``timeout`` s of silence."""
    if not conn.poll():
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(conn.fileno(), readable)
        try:
            await asyncio.wait_for(ready, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            loop.remove_reader(conn.fileno())
    try:
        return conn.recv()
    except EOFError:
        return None


async def _node(engine_id: str, tier: dict[str, Any], seed: int, conn: Connection) -> None:
    cache = pattern(seed)
    async with KVTier(node_config(engine_id, tier), [cache]) as kv:
        p2p = peer_tier(kv)
        conn.send(("ready", p2p.listen_address))
        while True:
            command = await _receive(conn, TIMEOUT_S)
            if command is None or command[0] == "exit":
                break
            conn.send(await _obey(kv, p2p, cache, command))


async def _obey(kv: KVTier, p2p: PeerTier, cache: torch.Tensor, command: tuple[Any, ...]) -> Any:
    what, *args = command
    if what == "store":
        prefix, count, first = args
        stored = await kv.store(keys(prefix, count), list(range(first, first + count)), prefix)
        kv.finish(prefix)
        await kv.drain()
        return stored
    if what == "wait_indexed":
        prefix, count, present, timeout = args
        ks = keys(prefix, count)
        return await wait_until(lambda: all(p2p.contains(k) is present for k in ks), timeout)
    if what == "wait_peers":
        outbound, inbound, timeout = args
        return await wait_until(
            lambda: len(p2p.connected_peers) >= outbound and p2p.inbound_peers >= inbound, timeout
        )
    if what == "fetch":
        # Look the keys up (promoting them from peers), copy them to GPU blocks from
        # ``first``, and answer how many arrived and the digest of those blocks.
        prefix, count, first, req_id, timeout = args
        ks = keys(prefix, count)
        started = time.monotonic()
        hits = await kv.lookup(ks, req_id, timeout=timeout)
        loaded = await kv.load(ks[:hits], list(range(first, first + hits)), req_id)
        elapsed = time.monotonic() - started
        kv.finish(req_id)
        return loaded, digest(cache, first, loaded), elapsed
    if what == "digest":
        first, count = args
        return digest(cache, first, count)
    if what == "reset":
        await kv.reset()
        return True
    if what == "status":
        return {
            "connected": p2p.connected_peers,
            "inbound": p2p.inbound_peers,
            "indexed": p2p.indexed_keys,
            "announced": p2p.announced_keys,
            "auth_failures": counter(kv, AUTH_FAILURES),
            "frames_rejected": counter(kv, FRAMES_REJECTED),
            "integrity_failures": counter(kv, Names.INTEGRITY_FAILURES),
        }
    raise ValueError(f"unknown command {what!r}")


# ----------------------------------------------------------- blocking framing


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts = []
    while size:
        part = sock.recv(size)
        if not part:
            raise ConnectionError("closed")
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


def send_frame(sock: socket.socket, kind: int, body: bytes = b"") -> None:
    sock.sendall(FRAME.pack(kind, len(body)) + body)


def recv_frame(sock: socket.socket, max_body: int = 1 << 24) -> tuple[Kind, bytes]:
    kind, length = parse_frame_header(recv_exactly(sock, FRAME.size))
    assert length <= max_body, f"a {kind.name} frame of {length} bytes"
    return kind, recv_exactly(sock, length)


class RawReader:
    """The dialing side of the protocol on a blocking socket."""

    def __init__(self, address: str, *, timeout: float = 10.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.node_id = os.urandom(16)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def handshake(self, secret: str, namespace: str) -> None:
        """Authenticate as a reader; raises if the owner does not prove the secret."""
        digest = ChunkFormat(namespace).digest
        nonce = os.urandom(32)
        send_frame(self.sock, Kind.HELLO, encode_hello(self.node_id, nonce, digest))
        kind, body = recv_frame(self.sock, PREAUTH_MAX_BODY)
        assert kind is Kind.HELLO, f"got {kind.name}"
        hello = decode_hello(body)
        key = Secret(secret.encode())
        mine = proof(
            key,
            Role.READER,
            prover_id=self.node_id,
            prover_nonce=nonce,
            challenger_id=hello.node_id,
            challenger_nonce=hello.nonce,
            digest=digest,
        )
        send_frame(self.sock, Kind.PROOF, mine)
        kind, body = recv_frame(self.sock, PREAUTH_MAX_BODY)
        assert kind is Kind.PROOF, f"got {kind.name}"
        expected = proof(
            key,
            Role.OWNER,
            prover_id=hello.node_id,
            prover_nonce=hello.nonce,
            challenger_id=self.node_id,
            challenger_nonce=nonce,
            digest=digest,
        )
        assert body == expected, "the owner failed to prove the secret"

    def fetch(self, request_id: int, wanted: list[bytes], chunk_bytes: int) -> dict[int, bytes]:
        """Fetch ``wanted``; returns position -> header + payload (empty if missing)."""
        send_frame(self.sock, Kind.FETCH, encode_fetch(request_id, wanted))
        answers: dict[int, bytes] = {}
        while len(answers) < len(wanted):
            kind, body = recv_frame(self.sock)
            if kind in (Kind.ANNOUNCE, Kind.WITHDRAW):
                continue
            answered, position = CHUNK_META.unpack_from(body)
            assert answered == request_id
            if kind is Kind.MISSING:
                answers[position] = b""
            else:
                assert kind is Kind.CHUNK and len(body) == chunk_body_bytes(chunk_bytes)
                answers[position] = body[CHUNK_META.size :]
        return answers


# ------------------------------------------------------------------ impostor


def impostor(mode: str, port: int, conn: Connection) -> None:
    """A fake owner that authenticates with the real secret, announces, and misbehaves.

    ``flip``: answers each fetch with a chunk whose header is right for the bytes it
    computed, and then one payload byte flipped on the wire. ``missing``: answers
    "missing". ``stall``: sends half of the first chunk, tells the parent, and hangs.
    """
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(TIMEOUT_S)
    conn.send(("ready", listener.getsockname()[1]))
    assert conn.poll(TIMEOUT_S)
    namespace, chunk_bytes, announced = conn.recv()
    sock, _ = listener.accept()
    sock.settimeout(TIMEOUT_S)
    with sock, listener:
        _owner_handshake(sock, namespace)
        send_frame(sock, Kind.ANNOUNCE, encode_key_list(announced))
        conn.send("announced")
        kind, body = recv_frame(sock)
        assert kind is Kind.FETCH
        request_id, wanted = decode_fetch(body, 1024)
        chunk_format = ChunkFormat(namespace)
        for position, key in enumerate(wanted):
            if mode == "missing":
                send_frame(sock, Kind.MISSING, CHUNK_META.pack(request_id, position))
                continue
            payload = bytearray(os.urandom(chunk_bytes))
            header = chunk_format.header(key, memoryview(payload))
            if mode == "flip":
                payload[len(payload) // 2] ^= 0x40
                meta = CHUNK_META.pack(request_id, position)
                send_frame(sock, Kind.CHUNK, meta + bytes(header) + bytes(payload))
            else:  # stall
                frame = FRAME.pack(Kind.CHUNK, chunk_body_bytes(chunk_bytes))
                meta = CHUNK_META.pack(request_id, position)
                sock.sendall(frame + meta + bytes(header) + bytes(payload[: chunk_bytes // 2]))
                conn.send("mid-transfer")
                time.sleep(TIMEOUT_S)  # until the parent kills this process
                return
        conn.send("answered")
        conn.poll(TIMEOUT_S)


def _owner_handshake(sock: socket.socket, namespace: str) -> None:
    digest = ChunkFormat(namespace).digest
    kind, body = recv_frame(sock, PREAUTH_MAX_BODY)
    assert kind is Kind.HELLO
    hello = decode_hello(body)
    assert hello.digest == digest
    node_id, nonce = os.urandom(16), os.urandom(32)
    send_frame(sock, Kind.HELLO, encode_hello(node_id, nonce, bytes(16)))
    kind, body = recv_frame(sock, PREAUTH_MAX_BODY)
    assert kind is Kind.PROOF
    key = Secret(SECRET.encode())
    expected = proof(
        key,
        Role.READER,
        prover_id=hello.node_id,
        prover_nonce=hello.nonce,
        challenger_id=node_id,
        challenger_nonce=nonce,
        digest=digest,
    )
    assert body == expected
    answer = proof(
        key,
        Role.OWNER,
        prover_id=node_id,
        prover_nonce=nonce,
        challenger_id=hello.node_id,
        challenger_nonce=hello.nonce,
        digest=digest,
    )
    send_frame(sock, Kind.PROOF, answer)
