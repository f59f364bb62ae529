"""Channels and transports: the in-memory fake, TLS over any channel, TCP sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import anyio
import pytest
import trustme

from kvtier.tiers.p2p.channel import Channel, TlsChannel, format_address
from kvtier.tiers.p2p.errors import PeerClosed
from kvtier.tiers.p2p.memory import MemoryTransport, channel_pair
from kvtier.tiers.p2p.sockets import SocketTransport

pytestmark = pytest.mark.anyio

# Every await below completes at once when the code is right; the bound only turns a
# hang (a broken channel) into a failure instead of the suite's timeout.
HANG_S = 10


async def receive(channel: Channel, size: int) -> bytes:
    buffer = bytearray(size)
    await channel.recv_exactly(memoryview(buffer))
    return bytes(buffer)


async def exchange(sender: Channel, receiver: Channel, payload: bytes) -> bytes:
    """Send ``payload`` while receiving it: a large one exceeds any in-flight buffer."""
    with anyio.fail_after(HANG_S):
        got, _ = await asyncio.gather(receive(receiver, len(payload)), sender.send(payload))
    return got


# ------------------------------------------------------------ memory channels


async def test_a_memory_pair_delivers_bytes_in_order_beyond_its_buffer():
    a, b = channel_pair(capacity=1024)
    payload = os.urandom(100_000)
    assert await exchange(a, b, payload) == payload
    assert await exchange(b, a, payload[::-1]) == payload[::-1]


async def test_each_end_of_a_memory_pair_names_the_other():
    a, b = channel_pair("reader:1", "owner:2")
    assert (a.peer, b.peer) == ("owner:2", "reader:1")


async def test_after_close_the_peer_reads_what_was_sent_then_end_of_stream():
    a, b = channel_pair()
    await a.send(b"last words")
    a.close()
    assert await receive(b, 10) == b"last words"
    assert await b.recv_into(memoryview(bytearray(8))) == 0


async def test_a_stream_that_ends_mid_read_raises_peer_closed_saying_where():
    a, b = channel_pair()
    await a.send(b"abc")
    a.close()
    with pytest.raises(PeerClosed, match="3 bytes into 8"):
        await receive(b, 8)


async def test_sending_to_a_closed_peer_fails():
    a, b = channel_pair()
    b.close()
    with pytest.raises(OSError):
        await a.send(b"anyone there?")


async def test_a_cancelled_read_writes_nothing_into_its_buffer():
    a, b = channel_pair()
    slot = bytearray(4)
    reading = asyncio.ensure_future(b.recv_into(memoryview(slot)))
    await asyncio.sleep(0)  # the read is waiting
    reading.cancel()
    await a.send(b"late")
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert slot == bytearray(4)
    assert await receive(b, 4) == b"late"


async def test_the_memory_transport_connects_a_dialer_to_the_listener_at_its_address():
    transport = MemoryTransport()
    listener = await transport.listen("node-a", 7070, backlog=4)
    dialed = await transport.connect("node-a", 7070)
    accepted = await listener.accept()
    assert dialed.peer == "node-a:7070"
    assert accepted.peer != dialed.peer
    assert await exchange(dialed, accepted, b"hello") == b"hello"
    listener.close()


async def test_the_memory_transport_refuses_an_address_nobody_listens_on():
    transport = MemoryTransport()
    with pytest.raises(ConnectionRefusedError):
        await transport.connect("node-a", 7070)
    listener = await transport.listen("node-a", 7070, backlog=4)
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        await transport.connect("node-a", 7070)


async def test_the_memory_transport_refuses_connections_beyond_the_backlog():
    transport = MemoryTransport()
    listener = await transport.listen("node-a", 1, backlog=1)
    await transport.connect("node-a", 1)
    with pytest.raises(ConnectionRefusedError):
        await transport.connect("node-a", 1)
    listener.close()


async def test_the_memory_transport_gives_port_0_a_free_port_and_refuses_a_bound_one():
    transport = MemoryTransport()
    first = await transport.listen("h", 0, backlog=1)
    second = await transport.listen("h", 0, backlog=1)
    assert first.address[1] != 0 and first.address != second.address
    with pytest.raises(OSError, match="in use"):
        await transport.listen(*first.address, backlog=1)
    first.close()
    second.close()


# ----------------------------------------------------------------------- TLS


def tls_context(ca: trustme.CA, trusted: trustme.CA, *, server: bool) -> ssl.SSLContext:
    """A mutual-TLS context: a certificate from ``ca``, trusting ``trusted``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    trusted.configure_trust(context)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


async def tls_pair(client: ssl.SSLContext, server: ssl.SSLContext) -> tuple[TlsChannel, TlsChannel]:
    a, b = channel_pair()
    dialer = TlsChannel(a, client, server_side=False, server_hostname="localhost")
    acceptor = TlsChannel(b, server, server_side=True)
    with anyio.fail_after(HANG_S):
        await asyncio.gather(dialer.handshake(), acceptor.handshake())
    return dialer, acceptor


async def test_tls_over_a_memory_pair_carries_bytes_both_ways():
    ca = trustme.CA()
    dialer, acceptor = await tls_pair(
        tls_context(ca, ca, server=False), tls_context(ca, ca, server=True)
    )
    payload = os.urandom(1 << 20)
    assert await exchange(dialer, acceptor, payload) == payload
    assert await exchange(acceptor, dialer, b"answer") == b"answer"


async def test_tls_refuses_a_peer_whose_certificate_another_authority_signed():
    cluster, stranger = trustme.CA(), trustme.CA()
    with pytest.raises(ssl.SSLError):
        await tls_pair(
            tls_context(stranger, cluster, server=False), tls_context(cluster, cluster, server=True)
        )


async def test_closing_a_tls_channel_closes_the_channel_beneath():
    ca = trustme.CA()
    dialer, acceptor = await tls_pair(
        tls_context(ca, ca, server=False), tls_context(ca, ca, server=True)
    )
    dialer.close()
    with pytest.raises(PeerClosed):
        await receive(acceptor, 1)


# ------------------------------------------------------------------- sockets


async def test_the_socket_transport_connects_over_loopback_with_nodelay_on_both_ends():
    transport = SocketTransport()
    listener = await transport.listen("127.0.0.1", 0, backlog=4)
    host, port = listener.address
    assert port != 0
    dialed = await transport.connect(host, port)
    accepted = await listener.accept()
    try:
        assert dialed.peer == format_address((host, port))
        for end in (dialed, accepted):
            assert end.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        payload = os.urandom(1 << 20)
        assert await exchange(dialed, accepted, payload) == payload
    finally:
        dialed.close()
        accepted.close()
        listener.close()


async def test_the_socket_transport_refuses_a_port_nobody_listens_on():
    transport = SocketTransport()
    listener = await transport.listen("127.0.0.1", 0, backlog=1)
    port = listener.address[1]
    listener.close()
    with pytest.raises(OSError):
        await transport.connect("127.0.0.1", port)


def test_an_ipv6_address_is_written_in_brackets():
    assert format_address(("::1", 7070)) == "[::1]:7070"
    assert format_address(("10.0.0.5", 7070)) == "10.0.0.5:7070"
