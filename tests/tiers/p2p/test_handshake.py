"""The shared-secret handshake, over in-memory channels: who gets in and who does not."""

from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any

import anyio
import pytest
import trustme

from kvtier._secrets import Secret
from kvtier.tiers.p2p.channel import Channel
from kvtier.tiers.p2p.errors import AuthError, LinkError, Reject, Rejected, SelfConnection
from kvtier.tiers.p2p.handshake import (
    HELLO,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Credentials,
    Role,
    authenticate_owner,
    authenticate_reader,
    decode_hello,
    encode_hello,
    proof,
)
from kvtier.tiers.p2p.memory import channel_pair
from kvtier.tiers.p2p.wire import FRAME, Kind, read_frame, send_frame

pytestmark = pytest.mark.anyio

HANG_S = 10
SECRET = Secret(b"the-cluster-secret-0123456789abcdef")
DIGEST = b"D" * 16
READER_ID, OWNER_ID = b"R" * 16, b"O" * 16


def nonce() -> bytes:
    return os.urandom(32)


async def both(reader: Any, owner: Any) -> tuple[Any, Any]:
    """Run both ends of a handshake; each result is a node id or the exception raised."""
    with anyio.fail_after(HANG_S):
        results = await asyncio.gather(reader, owner, return_exceptions=True)
    return results[0], results[1]


async def handshake(
    *,
    reader_secret: Secret[bytes] = SECRET,
    reader_id: bytes = READER_ID,
    reader_digest: bytes = DIGEST,
    owner_id: bytes = OWNER_ID,
) -> tuple[Any, Any]:
    a, b = channel_pair()
    return await both(
        authenticate_reader(a, reader_secret, reader_id, reader_digest, nonce()),
        authenticate_owner(b, SECRET, owner_id, DIGEST, nonce()),
    )


async def hang_up(handshake: Any, channel: Channel) -> Any:
    """``handshake``, closing ``channel`` if it fails, as the tier does."""
    try:
        return await handshake
    except BaseException:
        channel.close()
        raise


async def owner_answer(channel: Channel) -> tuple[Kind, bytes]:
    """The frame the owner sent last (reader-side view of its verdict)."""
    kind, body = await read_frame(channel, 256)
    return kind, bytes(body)


# ------------------------------------------------------------------ outcomes


async def test_nodes_with_the_same_secret_and_namespace_learn_each_others_id():
    reader, owner = await handshake()
    assert (reader.node_id, owner.node_id) == (OWNER_ID, READER_ID)
    assert reader.version == owner.version == PROTOCOL_VERSION


async def test_a_reader_with_the_wrong_secret_is_refused_by_the_owner():
    reader, owner = await handshake(reader_secret=Secret(b"another-secret-of-32-bytes-or-so!"))
    assert isinstance(reader, Rejected) and reader.reason is Reject.AUTHENTICATION
    assert isinstance(owner, AuthError) and "failed to prove" in str(owner)


async def test_a_reader_of_another_namespace_is_refused_before_any_proof():
    reader, owner = await handshake(reader_digest=b"X" * 16)
    assert isinstance(reader, Rejected) and reader.reason is Reject.NAMESPACE
    assert isinstance(owner, AuthError) and "another namespace" in str(owner)


async def test_a_node_that_dials_itself_is_told_so_and_both_ends_know():
    reader, owner = await handshake(owner_id=READER_ID)
    assert isinstance(reader, Rejected) and reader.reason is Reject.SELF
    assert isinstance(owner, SelfConnection)


async def test_an_owner_refuses_a_reader_of_a_version_older_than_it_speaks():
    a, b = channel_pair()
    hello = HELLO.pack(b"KVTP2P\r\n", MIN_PROTOCOL_VERSION - 1, READER_ID, nonce(), DIGEST)
    await send_frame(a, Kind.HELLO, hello)
    owner = await both(asyncio.sleep(0), authenticate_owner(b, SECRET, OWNER_ID, DIGEST, nonce()))
    assert isinstance(owner[1], AuthError) and "version 0" in str(owner[1])
    assert await owner_answer(a) == (Kind.REJECT, bytes([Reject.VERSION]))


@pytest.mark.parametrize("proposed", [MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, 9])
async def test_both_ends_speak_the_lower_of_the_readers_proposal_and_the_owners_version(proposed):
    a, b = channel_pair()
    reader, owner = await both(
        authenticate_reader(a, SECRET, READER_ID, DIGEST, nonce(), proposed),
        authenticate_owner(b, SECRET, OWNER_ID, DIGEST, nonce()),
    )
    agreed = min(proposed, PROTOCOL_VERSION)
    assert (reader.version, owner.version) == (agreed, agreed)
    assert (reader.node_id, owner.node_id) == (OWNER_ID, READER_ID)


async def test_a_version_1_reader_hears_version_1_from_a_newer_owner():
    """What a reader of the first release checks: the owner's HELLO says 1, exactly."""
    a, b = channel_pair()

    async def first_release_reader() -> int:
        await send_frame(a, Kind.HELLO, encode_hello(READER_ID, nonce(), DIGEST, version=1))
        answer = decode_hello((await read_frame(a, 256))[1]).version
        a.close()  # the rest of the handshake is as it always was
        return answer

    version, _ = await both(
        first_release_reader(), authenticate_owner(b, SECRET, OWNER_ID, DIGEST, nonce())
    )
    assert version == 1


async def test_a_reader_hangs_up_on_an_owner_answering_a_version_it_did_not_offer():
    a, b = channel_pair()

    async def odd_owner() -> None:
        await read_frame(b, 256)
        reply = HELLO.pack(b"KVTP2P\r\n", PROTOCOL_VERSION + 1, OWNER_ID, nonce(), bytes(16))
        await send_frame(b, Kind.HELLO, reply)

    reader, _ = await both(authenticate_reader(a, SECRET, READER_ID, DIGEST, nonce()), odd_owner())
    assert isinstance(reader, AuthError) and f"version {PROTOCOL_VERSION + 1}" in str(reader)


# ------------------------------------------------------------------- attacks


async def test_a_proof_recorded_on_one_connection_is_refused_on_another():
    """Replay: the owner's fresh nonce makes every connection's proof different."""
    reader_nonce = nonce()
    recorded: list[bytes] = []

    async def reader(channel: Channel, *, replay: bool) -> None:
        await send_frame(channel, Kind.HELLO, encode_hello(READER_ID, reader_nonce, DIGEST))
        owner_hello = decode_hello((await read_frame(channel, 256))[1])
        if replay:
            await send_frame(channel, Kind.PROOF, recorded[0])
            return
        recorded.append(
            proof(
                SECRET,
                Role.READER,
                prover_id=READER_ID,
                prover_nonce=reader_nonce,
                challenger_id=owner_hello.node_id,
                challenger_nonce=owner_hello.nonce,
                digest=DIGEST,
            )
        )
        await send_frame(channel, Kind.PROOF, recorded[0])

    a, b = channel_pair()
    _, accepted = await both(
        reader(a, replay=False), authenticate_owner(b, SECRET, OWNER_ID, DIGEST, nonce())
    )
    assert accepted.node_id == READER_ID  # the recording was a genuine proof
    a, b = channel_pair()
    _, replayed = await both(
        reader(a, replay=True), authenticate_owner(b, SECRET, OWNER_ID, DIGEST, nonce())
    )
    assert isinstance(replayed, AuthError) and "failed to prove" in str(replayed)
    assert await owner_answer(a) == (Kind.REJECT, bytes([Reject.AUTHENTICATION]))


async def test_a_readers_own_proof_reflected_back_by_an_impostor_is_refused():
    a, b = channel_pair()

    async def impostor() -> None:
        await read_frame(b, 256)
        await send_frame(b, Kind.HELLO, encode_hello(OWNER_ID, nonce(), bytes(16)))
        kind, body = await read_frame(b, 256)
        assert kind is Kind.PROOF
        await send_frame(b, Kind.PROOF, bytes(body))

    reader, _ = await both(authenticate_reader(a, SECRET, READER_ID, DIGEST, nonce()), impostor())
    assert isinstance(reader, AuthError) and "failed to prove" in str(reader)


PROOF_INPUTS: dict[str, Any] = {
    "secret": SECRET,
    "role": Role.READER,
    "prover_id": READER_ID,
    "prover_nonce": b"p" * 32,
    "challenger_id": OWNER_ID,
    "challenger_nonce": b"c" * 32,
    "digest": DIGEST,
}


@pytest.mark.parametrize(
    ("changed", "value"),
    [
        ("secret", Secret(b"x" * 32)),
        ("role", Role.OWNER),
        ("prover_id", b"z" * 16),
        ("prover_nonce", b"z" * 32),
        ("challenger_id", b"z" * 16),
        ("challenger_nonce", b"z" * 32),
        ("digest", b"z" * 16),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_proof_depends_on_every_input(changed, value):
    assert proof(**{**PROOF_INPUTS, changed: value}) != proof(**PROOF_INPUTS)


def test_swapping_prover_and_challenger_changes_the_proof():
    swapped = {
        **PROOF_INPUTS,
        "prover_id": OWNER_ID,
        "challenger_id": READER_ID,
        "prover_nonce": b"c" * 32,
        "challenger_nonce": b"p" * 32,
    }
    assert proof(**swapped) != proof(**PROOF_INPUTS)


# ------------------------------------------------------- before authenticating


@pytest.mark.parametrize(
    ("first", "problem"),
    [
        (FRAME.pack(Kind.FETCH, 4) + b"\0\0\0\0", "expected a HELLO frame"),
        (FRAME.pack(Kind.HELLO, 1 << 40), "before authentication"),
        (FRAME.pack(Kind.HELLO, 5) + b"hello", "malformed hello"),
        (FRAME.pack(Kind.HELLO, HELLO.size) + b"GET / HTTP/1.1\r\n".ljust(HELLO.size), "not a"),
        (b"GET / HTTP/1.1\r\nHost: kvtier\r\n\r\n", "before authentication"),
    ],
    ids=["fetch-first", "oversized", "short-hello", "foreign-magic", "http"],
)
async def test_an_owner_refuses_anything_but_a_hello_first(first, problem):
    a, b = channel_pair()
    await a.send(first)
    a.close()
    _, owner = await both(
        asyncio.sleep(0), authenticate_owner(b, SECRET, OWNER_ID, DIGEST, nonce())
    )
    assert isinstance(owner, AuthError) and problem in str(owner)


async def test_a_reject_frame_with_an_unknown_reason_still_ends_the_handshake():
    a, b = channel_pair()
    await b.send(FRAME.pack(Kind.REJECT, 1) + b"\x77")
    reader, _ = await both(
        authenticate_reader(a, SECRET, READER_ID, DIGEST, nonce()), asyncio.sleep(0)
    )
    assert isinstance(reader, AuthError) and not isinstance(reader, Rejected)


# ----------------------------------------------------------------- credentials


def tls_context(ca: trustme.CA, *, server: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ca.issue_cert("localhost").configure_cert(context)
    ca.configure_trust(context)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


async def test_credentials_authenticate_inside_mutual_tls():
    ca = trustme.CA()
    reader = Credentials(SECRET, READER_ID, DIGEST, client_tls=tls_context(ca, server=False))
    owner = Credentials(SECRET, OWNER_ID, DIGEST, server_tls=tls_context(ca, server=True))
    a, b = channel_pair()
    dialed, accepted = await both(reader.as_reader(a, "localhost"), owner.as_owner(b))
    assert dialed[1].node_id == OWNER_ID and accepted[1].node_id == READER_ID
    await dialed[0].send(b"sealed")
    got = bytearray(6)
    await accepted[0].recv_exactly(memoryview(got))
    assert got == b"sealed"


async def test_credentials_without_tls_do_not_speak_to_an_owner_that_requires_it():
    ca = trustme.CA()
    reader = Credentials(SECRET, READER_ID, DIGEST)
    owner = Credentials(SECRET, OWNER_ID, DIGEST, server_tls=tls_context(ca, server=True))
    a, b = channel_pair()
    dialed, accepted = await both(reader.as_reader(a, "localhost"), hang_up(owner.as_owner(b), b))
    assert isinstance(accepted, ssl.SSLError)
    assert isinstance(dialed, (LinkError, OSError))


def test_credentials_never_show_the_secret():
    assert SECRET.value.decode() not in repr(Credentials(SECRET, READER_ID, DIGEST))
