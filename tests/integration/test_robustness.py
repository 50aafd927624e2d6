"""The worker keeps serving after garbage, failed handshakes and broken framing (rule 4).

Each case abuses the server over a raw socket; afterwards a real session on
its own connection must still get correct results.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable

import msgspec
import pytest
import torch

import remotorch
from remotorch.codec import messages as m
from remotorch.transport import TcpTransport
from remotorch.transport import framing, handshake

from conftest import TOKEN
from helpers import Probe, assert_still_serves, tiny_mlp

PROTOCOL = m.PROTOCOL_VERSION


def connect(server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.settimeout(10)
    return sock


def recv_until_closed(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while len(data) < limit:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    return data


def authenticated(server) -> tuple[socket.socket, bytes]:
    sock = connect(server)
    key = handshake.client_handshake(sock, TOKEN.encode(), PROTOCOL)
    return sock, key


def framed(key: bytes, seq: int, header: bytes, frames: tuple = ()) -> bytes:
    """One client message exactly as FramedChannel.send lays it out."""
    send_key, _ = framing.direction_keys(key, "client")
    return b"".join(bytes(p) for p in framing.encode_message(send_key, seq, header, frames))


def read_reply(sock: socket.socket, key: bytes, seq: int = 0):
    channel = framing.FramedChannel(sock, key, role="client", max_frame=1 << 30, max_header=1 << 30, recv_seq=seq)
    header, frames, _ = channel.recv()
    return m.decode(header), frames


# ----------------------------------------------------------------------- the abuses
def random_bytes(server) -> None:
    with connect(server) as sock:
        try:
            sock.sendall(b"GET / HTTP/1.1\r\n" + os.urandom(4096))
        except OSError:
            pass
        assert recv_until_closed(sock) == b""  # not a hello: closed without an answer


def connect_and_close(server) -> None:
    connect(server).close()


def partial_hello(server) -> None:
    with connect(server) as sock:
        sock.sendall(handshake.HELLO + b"\x01\x00")


def hello_with_wrong_proof(server) -> None:
    with connect(server) as sock:
        sock.sendall(struct.pack("<4sI32s", handshake.HELLO, PROTOCOL, os.urandom(32)))
        answer = handshake.recv_exact(sock, 40 + framing.MAC_SIZE).tobytes()
        assert answer[:4] == handshake.HELLO
        sock.sendall(os.urandom(framing.MAC_SIZE))
        assert recv_until_closed(sock) == b"\x00"  # refused, then closed


def hello_with_wrong_version(server) -> None:
    with connect(server) as sock:
        sock.sendall(struct.pack("<4sI32s", handshake.HELLO, PROTOCOL + 41, os.urandom(32)))
        answer = recv_until_closed(sock)
        # the worker tells its own version (so the client can say what is wrong), then closes
        assert len(answer) == 40 + framing.MAC_SIZE
        magic, version, _ = struct.unpack("<4sI32s", answer[:40])
        assert magic == handshake.HELLO and version == PROTOCOL


def client_refuses_server(server) -> None:
    """A client with another token stops the handshake itself: the server must cope."""
    with connect(server) as sock:
        with pytest.raises(framing.AuthFailed):
            handshake.client_handshake(sock, b"another token", PROTOCOL)


def refused_after_auth(name: str, message: Callable[[bytes], bytes]) -> Callable:
    """The abuse: after a good handshake, ``message(key)``; the worker answers it with a protocol
    error, then closes the connection."""

    def abuse(server) -> None:
        sock, key = authenticated(server)
        with sock:
            sock.sendall(message(key))
            reply, _ = read_reply(sock, key)
            assert isinstance(reply, m.ErrorReply) and reply.kind == "protocol"
            assert recv_until_closed(sock) == b""

    abuse.__name__ = name
    return abuse


def dropped_after_auth(name: str, *messages: Callable[[bytes], bytes]) -> Callable:
    """The abuse: after a good handshake (a new connection for each), each of ``messages(key)``; the
    worker closes the connection without an answer."""

    def abuse(server) -> None:
        for message in messages:
            sock, key = authenticated(server)
            with sock:
                sock.sendall(message(key))
                assert recv_until_closed(sock) == b""

    abuse.__name__ = name
    return abuse


garbage_after_auth = refused_after_auth("garbage_after_auth", lambda key: b"XXXX" + os.urandom(200))
oversized_frame_claim = refused_after_auth("oversized_frame_claim", lambda key: (
    struct.pack("<4sQI", framing.MAGIC, 0, 2) + struct.pack("<2Q", 10, 1 << 62) + os.urandom(framing.MAC_SIZE)))
zero_frames_claim = refused_after_auth("zero_frames_claim", lambda key: struct.pack("<4sQI", framing.MAGIC, 0, 0))
too_many_frames_claim = refused_after_auth("too_many_frames_claim", lambda key: (
    struct.pack("<4sQI", framing.MAGIC, 0, framing.MAX_FRAMES + 1)))
bad_mac_after_auth = dropped_after_auth(  # a message MAC'd with another key
    "bad_mac_after_auth", lambda key: framed(os.urandom(32), 0, m.encode(m.Health())))


def replayed_message(server) -> None:
    sock, key = authenticated(server)
    with sock:
        message = framed(key, 0, m.encode(m.Health()))
        sock.sendall(message)
        reply, _ = read_reply(sock, key)
        assert isinstance(reply, m.HealthReply)
        sock.sendall(message)  # same sequence number again
        assert recv_until_closed(sock) == b""


def flipped(index: int, body, frames: tuple = ()) -> Callable[[bytes], bytes]:
    """A correctly MAC'd message with the byte at ``index`` changed in flight."""

    def message(key: bytes) -> bytes:
        data = bytearray(framed(key, 0, m.encode(body), frames))
        data[index] ^= 0x01
        return bytes(data)

    return message


# A correctly MAC'd message whose frame 0 was changed in flight is dropped unanswered
# (first byte of frame 0, after the 16-byte fixed part and one length).
altered_header_after_auth = dropped_after_auth("altered_header_after_auth", flipped(24, m.Health()))
# Tensor bytes changed in flight (header intact) fail the MAC: dropped unanswered. Both ways of
# covering buffer frames are tried: inside the HMAC (small frames) and through the chunk tags
# (large frames).
altered_buffer_frame_after_auth = dropped_after_auth("altered_buffer_frame_after_auth", *(
    flipped(-(framing.MAC_SIZE + 10), m.Echo(), (b"\x00" * size,)) for size in (1000, framing.INLINE_MAC + 1)))


def truncated_message(server) -> None:
    sock, key = authenticated(server)
    with sock:
        message = framed(key, 0, m.encode(m.Echo()), (b"\x00" * 100_000,))
        sock.sendall(message[:-50_000])  # then hang up half-way through a frame


def silent_connection(server) -> None:
    """A client that authenticates and then says nothing must not block others (checked while open)."""
    sock, _ = authenticated(server)
    silent_connection.sock = sock  # closed by the test after the check


ABUSES = [random_bytes, connect_and_close, partial_hello, hello_with_wrong_proof, hello_with_wrong_version,
          client_refuses_server, garbage_after_auth, bad_mac_after_auth, replayed_message,
          oversized_frame_claim, zero_frames_claim, too_many_frames_claim, altered_header_after_auth,
          altered_buffer_frame_after_auth,
          truncated_message, silent_connection]


@pytest.fixture
def probe(session):
    """A compiled model on the shared server, checked once: each call checks a correct answer (a fresh input)."""
    p = Probe(session, tiny_mlp(12, 24, 3, act=torch.nn.Tanh), lambda: torch.randn(5, 12))
    p()
    return p


@pytest.mark.parametrize("abuse", ABUSES, ids=[a.__name__ for a in ABUSES])
def test_worker_survives(server, probe, make_session, abuse):
    abuse(server)
    try:
        # the session that was open before, and a brand-new connection
        assert_still_serves(make_session(), probe=probe, server=server)
    finally:
        sock = getattr(abuse, "sock", None)
        if sock is not None:
            sock.close()
            del abuse.sock
    assert server.alive()


def test_malformed_headers_get_error_replies_on_the_same_connection(server):
    transport = TcpTransport(server.url, TOKEN, protocol=PROTOCOL, connect_timeout=5, timeout=30)
    try:
        headers = [
            os.urandom(64),
            b"",
            msgspec.msgpack.encode([PROTOCOL]),
            msgspec.msgpack.encode([PROTOCOL, {"type": "no_such_request"}]),
            msgspec.msgpack.encode([PROTOCOL + 1, {"type": "health"}]),
            msgspec.msgpack.encode({"v": PROTOCOL, "body": {"type": "health"}}),
            msgspec.msgpack.encode([PROTOCOL, {"type": "run", "graph_id": 1, "engine": [], "args": {}}]),
            m.encode(m.Ok()),  # a reply is not a request
        ]
        for header in headers:
            reply_header, frames = transport.request(header)
            reply = m.decode(reply_header)
            assert isinstance(reply, m.ErrorReply), header
            assert reply.kind in ("protocol", "invalid"), reply
            assert frames == []
        reply_header, _ = transport.request(m.encode(m.Health()))
        assert isinstance(m.decode(reply_header), m.HealthReply)
    finally:
        transport.close()


def test_requests_that_do_not_fit_get_typed_errors(session, server):
    """Well-formed requests that name nothing, or the wrong things, are answered with errors."""
    transport = TcpTransport(server.url, TOKEN, protocol=PROTOCOL, connect_timeout=5, timeout=30)
    try:
        def ask(body, frames=()):
            header, out = transport.request(m.encode(body), frames)
            return m.decode(header)

        reply = ask(m.Run("0" * 64, "eager", []))
        assert isinstance(reply, m.ErrorReply) and reply.kind == "missing"
        assert reply.graphs == ["0" * 64]
        reply = ask(m.PutGraph("f" * 64, b"doc", []))
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"  # id is not the content hash
        meta = m.TensorMeta("float32", [4], [1], 3)
        reply = ask(m.PutTensors(["x"], [meta]), [b"\x00" * 16])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"  # frame 3 does not exist
        reply = ask(m.PutTensors(["not-the-hash"], [m.TensorMeta("float32", [4], [1], 0)]), [b"\x00" * 16])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"
        doc = msgspec.msgpack.encode({"format": 1, "nodes": [{"op": "const", "index": 0},
                                                              {"op": "output", "args": [{"$n": "v0"}]}]})
        const = m.TensorMeta("uint8", [4], [1], 1)  # constant 0 must be in frame 0
        gid = remotorch.codec.graph.graph_id(doc, [const], [b"abcd"])
        reply = ask(m.PutGraph(gid, doc, [const]), [b"abcd"])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"
        reply = ask(m.PutGraph(gid, doc, [const]), [])  # constants without frames
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"
        reply = ask(m.PutGraph(remotorch.codec.graph.graph_id(b"\x80junk", [], []), b"\x80junk", []))
        assert isinstance(reply, m.ErrorReply) and reply.kind == "unsupported"
        reply = ask(m.PutTensors(["a", "b"], [m.TensorMeta("uint8", [1], [1], 0)]), [b"x"])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"  # counts disagree
        rank65 = m.TensorMeta("uint8", [1] * 65, [1] * 65, 0)
        reply = ask(m.PutTensors([remotorch.codec.tensors.content_id(rank65, memoryview(b"x"))], [rank65]),
                    [b"x"])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"
        reply = ask(m.Echo(), [b"abc", b"", b"\x00" * 1000])
        assert isinstance(reply, m.EchoReply)
    finally:
        transport.close()
    assert_still_serves(session)


def test_wrong_argument_count_and_dtype_are_invalid_requests(session, server):
    """A graph run with the wrong arguments is refused before it runs."""
    torch.manual_seed(0)
    compiled = remotorch.compile(lambda a, b: a * b + 1, session=session, fallback="raise")
    a, b = torch.randn(3), torch.randn(3)
    assert torch.equal(compiled(a, b), a * b + 1)
    gid = next(iter(session.connection.graphs))
    transport = session.connection.transport  # the same connection: it holds the graph
    meta_f, buf_f = remotorch.codec.tensors.tensor_to_wire(a, 0)
    meta_i, buf_i = remotorch.codec.tensors.tensor_to_wire(torch.arange(3), 1)
    meta_long, buf_long = remotorch.codec.tensors.tensor_to_wire(torch.randn(4), 1)
    meta_2d, buf_2d = remotorch.codec.tensors.tensor_to_wire(torch.randn(1, 3), 1)
    cases = [
        ([m.TensorArg(meta_f)], [buf_f], "invalid"),  # one argument short
        ([m.TensorArg(meta_f)] * 3, [buf_f], "invalid"),  # one too many
        ([m.TensorArg(meta_f), m.TensorArg(meta_i)], [buf_f, buf_i], "invalid"),  # int64 for float32
        ([m.TensorArg(meta_f), m.TensorArg(meta_long)], [buf_f, buf_long], "invalid"),  # wrong size
        ([m.TensorArg(meta_f), m.TensorArg(meta_2d)], [buf_f, buf_2d], "invalid"),  # wrong rank
        ([m.TensorArg(meta_f), m.ScalarArg(2.0)], [buf_f], "invalid"),  # a scalar for a tensor
        ([m.TensorArg(meta_f), m.TensorArg(meta_i)], [buf_f], "invalid"),  # frame 1 is not there
        ([m.TensorArg(meta_f), m.RefArg("nope")], [buf_f], "missing"),  # never uploaded
    ]
    for args, frames, kind in cases:
        header, _ = transport.request(m.encode(m.Run(gid, "eager", args)), frames)
        reply = m.decode(header)
        assert isinstance(reply, m.ErrorReply), args
        assert reply.kind == kind, (args, reply)
    assert torch.equal(compiled(a, b), a * b + 1)
